"""The `jaxtrain` command: train, inspect, launch, prepare-data, checkpoints, and more.

User errors (bad config, missing data, a mesh that does not fit the devices, an incompatible
checkpoint) print one line on stderr and exit 2, with nothing written. JAX is imported only
after `--cpu-devices` has configured XLA: each verb's module is imported when it runs, so
`jaxtrain launch` and `jaxtrain recovery` never import JAX.
"""

from __future__ import annotations

import sys

from jaxtrain.commands import startup  # noqa: F401  (first: its STARTED_AT is taken before JAX is imported)
from jaxtrain.storage.object_store import TransientStorageError  # (no JAX import)
from jaxtrain.config import ConfigError
from jaxtrain.observe.console import install_stderr_logging
from jaxtrain.runtime.exit_codes import EXIT_OK, EXIT_RESTART, EXIT_USAGE


def _verb(module: str):
    """A verb's `main(argv) -> int`, from its module under jaxtrain/commands/, imported when it runs."""
    def run(argv: list[str]) -> int:
        import importlib
        return importlib.import_module(f"jaxtrain.commands.{module}").main(argv)
    return run


COMMANDS = {
    "train": (_verb("train"), "train (one process per host); resumes from the run directory"),
    "inspect": (_verb("inspect_cmd"), "compile the step from shapes alone; report FLOPs, memory and collectives"),
    "launch": (_verb("launch"), "start and supervise several local processes of one job"),
    "recovery": (_verb("recovery"), "for scheduler scripts: after a failed attempt, restart, isolate a node or give up"),
    "prepare-data": (_verb("prepare_data"), "tokenize text/jsonl files into token files"),
    "checkpoints": (_verb("checkpoints"), "list the checkpoints of a run directory"),
    "preflight": (_verb("preflight"), "measure every process's devices and links; name the bad ones"),
    "profile-summary": (_verb("profile_summary"), "split a run's profiled steps into compute, collectives and waits"),
    "import-hf": (_verb("import_hf"), "convert a Hugging Face Llama checkpoint for jaxtrain"),
    "export-hf": (_verb("export_hf"), "write a run's parameters as a Hugging Face Llama checkpoint"),
    "eval": (_verb("evaluate"), "a trained model's loss, perplexity and tokens over a whole held-out set"),
    "generate": (_verb("generate"), "continue prompts with a trained model (a run or a Hugging Face directory)"),
    "lm-eval": (_verb("lm_eval"), "lm-evaluation-harness tasks on a trained model (pip install 'jaxtrain[eval]')"),
    "goodput": (_verb("goodput"), "where a run's wall time went: productive steps, start-up, restarts, ..."),
}


def usage() -> str:
    verbs = "\n".join(f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items())
    return f"usage: jaxtrain COMMAND [ARGS]  (jaxtrain COMMAND --help for its arguments)\ncommands:\n{verbs}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    install_stderr_logging()  # the library's warnings and drill notices: `jaxtrain: ...` lines on stderr
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return EXIT_OK if argv else EXIT_USAGE
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise ConfigError(f"unknown command '{argv[0]}'; commands: {', '.join(COMMANDS)}")
        return command[0](argv[1:])
    except ConfigError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TransientStorageError as e:  # a 5xx, throttling or timeout, retried: restart, do not stop the job
        print(f"jaxtrain: storage unavailable (transient), restart me: {e}", file=sys.stderr)
        return EXIT_RESTART
    except SystemExit as e:  # --help of a subcommand
        return int(e.code or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
