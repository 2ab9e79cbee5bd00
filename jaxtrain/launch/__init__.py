"""Entry points that start processes, and the recovery policy they share.

`distributed.py` joins a multi-host job. `jaxtrain launch` (`supervisor.py`) starts and supervises
the local processes of one job; what to do once an attempt has ended is `policy.py` (pure
functions), the same for `train.sbatch` through `jaxtrain recovery` (`recovery_cli.py`). Beside
them: `elastic.py` (the same run on fewer processes), `runfiles.py` (reading a run directory's
metrics and events), `train_command.py` (the `train ...` command a launcher runs). Beside `cli`;
nothing below imports this package.
"""
