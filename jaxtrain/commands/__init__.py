"""The `jaxtrain` command: the entry wing, above everything else (nothing in the package imports it).

`cli.py` dispatches `jaxtrain VERB ...` (user errors exit 2, transient storage errors 75) to one module
per verb: `train.py`, `inspect_cmd.py`, `launch.py`, `recovery.py`, `prepare_data.py`, `checkpoints.py`,
`preflight.py`, `profile_summary.py`, `import_hf.py`, `export_hf.py`, `goodput.py`. Each holds its
argument parser, its `main(argv) -> int` and its printing; the work is the library's (functions that
return data, summaries and strings). Shared: `arguments.py` (parsing rules), `startup.py` (configuring
XLA and joining the job before JAX starts), `train_command.py` (the `train ...` part of a launcher's
command line).
"""
