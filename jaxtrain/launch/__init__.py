"""Entry points that start processes, and the recovery policy they share.

Joining a multi-host job is `jaxtrain/runtime/distributed.py`. `jaxtrain launch` (`supervisor.py`) starts and supervises
the local processes of one job; what to do once an attempt has ended is `policy.py` (pure
functions), the same for `train.sbatch` through `jaxtrain recovery` (`recovery_state.py`: its state
folder). Beside them: `elastic.py` (the same run on fewer processes), `runfiles.py` (reading a run
directory's metrics and events). The verbs' parsers and `main`s are `jaxtrain/commands/` (`launch.py`,
`recovery.py`), the only package that imports this one.
"""
