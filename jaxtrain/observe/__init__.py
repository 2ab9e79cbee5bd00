"""Numbers that show where time goes: run logs (`runlog.py`, `tensorboard.py`), throughput and MFU
(`throughput.py`), profiles (`profiling.py`), `jaxtrain inspect` (`inspection.py`) and
`jaxtrain goodput` (`goodput.py`)."""
