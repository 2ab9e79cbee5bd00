"""Entry points that start processes: joining a multi-host job (`distributed.py`) and the local
supervisor of `jaxtrain launch` (`supervisor.py`). Beside `cli`; nothing below imports it."""
