"""`jaxtrain preflight --config PATH [key=value ...] [--cpu-devices N] [--json]`: the health check
alone (`fault/preflight.py` measures; process 0 prints the report).
"""

from __future__ import annotations

import json

from jaxtrain.commands import startup
from jaxtrain.commands.arguments import Parser, add_run_arguments, parse
from jaxtrain.runtime import env
from jaxtrain.runtime.exit_codes import EXIT_OK


def main(argv: list[str]) -> int:
    """`jaxtrain preflight --config PATH [key=value ...] [--cpu-devices N] [--json]`: the check alone."""
    from jaxtrain.config import load_config
    from jaxtrain.runtime.exit_codes import EXIT_RESTART
    p = Parser(prog="jaxtrain preflight", description="Measure every process's devices and links; name the bad ones.")
    add_run_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parse(p, argv)
    cfg = load_config(args.config, args.overrides)
    startup.start_jax(args.cpu_devices, cfg)
    import jax

    from jaxtrain.fault.preflight import run_preflight
    from jaxtrain.fault.stragglers import job_hosts
    from jaxtrain.parallel.mesh import build_mesh, slice_count, validate_against_devices
    validate_against_devices(cfg, jax.device_count(), jax.process_count(), num_slices=slice_count(jax.devices()))
    mesh = build_mesh(cfg.mesh, jax.devices())
    hosts = job_hosts(jax.process_index(), jax.process_count(), host=env.host_name())
    report = run_preflight(cfg, mesh, hosts, lambda *a, **k: None)
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(report))
        else:
            print(f"matmul TFLOP/s per process: {report['matmul_tflops']} (median {report['median_matmul_tflops']})")
            for axis, b in report["axes_gbps"].items():
                print(f"mesh axis {axis}: all-reduce {b['all_reduce_gbps']} GB/s, all-gather {b['all_gather_gbps']} GB/s")
            for pair, v in report["pairs_gbps"].items():
                print(f"processes {pair}: {v} GB/s")
            print(f"below {report['factor']} x median: processes {report['named'] or 'none'}; "
                  f"pairs {report['slow_pairs'] or 'none'}")
    return EXIT_RESTART if report["named"] and cfg.fault.preflight_action == "exit" else EXIT_OK
