"""`jaxtrain lm-eval (RUN_DIR [--step N] | --hf DIR) --tasks T1,T2`: lm-evaluation-harness tasks on a
trained model, scored and decoded by jaxtrain (`jaxtrain.infer.lm_eval_adapter`); prints lm-eval's
results table, and with `--output FILE` writes its results as JSON.

Tasks are lm-eval's own (which fetch their data sets from the Hugging Face hub) or YAML files of a
folder given with `--include-path` (local data: `dataset_path: json` with `dataset_kwargs.data_files`).
lm-eval is optional: `pip install 'jaxtrain[eval]'`. One process, one device.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import sys
from pathlib import Path

from jaxtrain.commands.arguments import Parser, add_model_arguments, check_model_arguments
from jaxtrain.commands.startup import set_cpu_devices, set_cpu_flags
from jaxtrain.config import ConfigError


def parser() -> Parser:
    p = Parser(prog="jaxtrain lm-eval", description="lm-evaluation-harness tasks on a trained model.")
    add_model_arguments(p)
    p.add_argument("--tasks", required=True, metavar="T1,T2", help="lm-eval task (or group) names, comma-separated")
    p.add_argument("--include-path", metavar="DIR", help="a folder of task YAML files (local tasks)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="examples in each prompt (default: the task's)")
    p.add_argument("--limit", type=float, default=None, metavar="N",
                   help="at most N examples per task (below 1: that fraction)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per device call (default 8)")
    p.add_argument("--output", metavar="FILE", help="write lm-eval's results as JSON")
    return p


def check_tasks(names: list[str], task_manager) -> None:
    """Every name a task, group or tag lm-eval knows (or a task YAML file); else one line naming it."""
    known = set(task_manager.all_tasks)
    for name in names:
        if name in known or (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            continue
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"--tasks: unknown lm-eval task '{name}'{hint} (--include-path DIR adds a folder of "
                          "task YAML files)")


def task_manager_for(names: list[str], include_path: str | None):
    """lm-eval's TaskManager: of the --include-path folder alone when every name is a task of its own
    there (indexing lm-eval's ~15,000 built-in task files takes seconds), else of both (the folder's win)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    include = str(Path(include_path).expanduser()) if include_path else None
    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        index = local.task_index
        if all(name in index and index[name].kind in (Kind.TASK, Kind.PY_TASK) for name in names):
            return local
    return TaskManager(include_path=include)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_model_arguments(args)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be positive, got {args.limit}")
    if args.include_path and not Path(args.include_path).expanduser().is_dir():
        raise ConfigError(f"--include-path '{args.include_path}' is not a directory")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: no task named")
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("lm-eval is not installed: pip install 'jaxtrain[eval]'")
    if "jax" not in sys.modules:
        set_cpu_flags(args.cpu_devices)
    set_cpu_devices(args.cpu_devices)

    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table

    from jaxtrain.infer.lm_eval_adapter import JaxtrainLM

    task_manager = task_manager_for(tasks, args.include_path)
    check_tasks(tasks, task_manager)  # before the model loads
    model = JaxtrainLM(run_dir=args.run_dir, step=args.step, hf=args.hf, batch_size=args.batch_size)
    limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
    try:
        results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                                          task_manager=task_manager, log_samples=False)
    except KeyError as e:  # a group naming a task that is not there
        raise ConfigError(f"--tasks: {e.args[0] if e.args else e}") from None
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        out = Path(args.output).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return 0
