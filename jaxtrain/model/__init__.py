"""The model: the Llama decoder (`llama.py`) and the fused chunked output head + loss (`loss.py`).

Model code names logical axes and never mesh axes; it imports nothing from checkpointing, data,
metrics or the CLI.
"""
