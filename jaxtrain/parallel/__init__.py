"""Parallelism: the device mesh (`mesh.py`), logical-axis sharding through the one rules table
(`sharding.py`) and pipeline stages as a scan loop (`pipeline.py`)."""
