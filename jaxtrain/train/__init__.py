"""Training maths and its host-side policy: the pure train step (`step.py`), the optimizer and
learning-rate schedule (`optim.py`), the state's shapes and shardings (`state.py`), precision
policies and loss scaling (`precision.py`), spike statistics inside the step (`stability.py`), the
host-side rollback policy and its log (`rollback.py`), evaluation (`evaluation.py`)."""
