"""Process exit codes: the contract between `jaxtrain`, `jaxtrain launch` and cluster schedulers.

Defined once here; everything that exits or interprets an exit status imports these names.
"""

EXIT_OK = 0  # training finished (or the command succeeded)
EXIT_USAGE = 2  # bad usage, config or input: one line on stderr, nothing written; never restart
EXIT_RESTART = 75  # "restart me": preempted after an emergency checkpoint, a hang, a transient storage error
# "Stop, a human is needed": restarting would hit the same wall (the rollback budget is spent, the
# same deterministic failure came back). Every recipe treats it like EXIT_USAGE: never restarted.
EXIT_HUMAN = 78
