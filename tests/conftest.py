"""Every test runs on the CPU with 8 simulated devices (set before JAX is imported)."""

import os
import sys

# Tests live in one folder per part of the system (tests/fault/, tests/parallel/, ...); the
# helpers they share (trees.py, storage_servers.py, independent_attention.py) stay here.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton kernels run under the Triton interpreter here (no GPU). Triton reads this when its
# decorators run, and transformers/torch (tests/hf/test_hf.py) import triton at collection time,
# before tests/kernels/test_kernels_triton.py could set it.
os.environ["TRITON_INTERPRET"] = "1"
# gcsfs reads this once, at import: whichever test imports it first decides for the whole session.
# Its default (true) looks up every bucket's type over a gRPC API that the GCS emulator and the
# tests' fake endpoints lack, 60 s per lookup (tests/storage_servers.py sets it for subprocesses).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Most XLA optimizations only cost compile time on these tiny test models (as in flax's lm1b
# test); numerics are compared between runs that all use the same flag.
jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a job a test starts (`jaxtrain launch`, several processes): the CPU, this
    checkout importable, no 8-device flag (the launcher sets devices per process), no restart
    attempt inherited, and `CACHE`, a compilation-cache folder shared by the test module's jobs."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXTRAIN_RESTART_ATTEMPT")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    env["CACHE"] = str(tmp_path_factory.mktemp("xla_cache"))
    return env


# First: xdist's worker turns the xdist_group marker into the node id's "@group" suffix in its own
# pytest_collection_modifyitems, registered after this file (so called before it, hooks being
# last-registered-first). Without tryfirst the marker came too late and both workers ran
# multi-process tests at once.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) the tests that start
    several processes, or a SLURM job, run one at a time on one worker: they already use every
    core, and their deadlines (hang timeouts, straggler factors) assume they are not sharing the
    machine with another such job. The in-process tests, mostly single-threaded compiles, share
    the other worker."""
    for item in items:
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("slow") or \
                item.path.name == "test_slurm.py":
            item.add_marker(pytest.mark.xdist_group("processes"))
