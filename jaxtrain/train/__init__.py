"""Training maths: the pure train step (`step.py`), the state's shapes and shardings (`state.py`),
precision policies and loss scaling (`precision.py`), in-step stability statistics and the
host-side rollback policy (`stability.py`), evaluation (`evaluation.py`)."""
