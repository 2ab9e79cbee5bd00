#!/usr/bin/env bash
# Install jaxtrain for NVIDIA GPUs. Run from anywhere inside a checkout.
#
# Online (a normal GPU host: Python >= 3.11, NVIDIA driver for CUDA 12), into the active virtualenv:
#   python3 -m venv ~/venv && source ~/venv/bin/activate
#   tpu_gpu_setup/gpu/install.sh
#   # = pip install -e '.[gpu]'   (jax[cuda12] with its CUDA wheels, jax-triton, triton)
#
# Offline (the lent H200 machine: Python 3.12 with jax 0.11.2 for CUDA 13, flax, optax, orbax,
# tensorstore and triton 3.6 preinstalled, no network, no jax-triton; see DESIGN.md §6 and
# check_attention.md beside this file, which uses the same .whl/ directory):
#   # 1. here, with network, in the checkout (.whl/ is git-ignored locally; carry it to the machine):
#   echo /.whl/ >> .git/info/exclude
#   tpu_gpu_setup/gpu/install.sh --download-wheels          # jax-triton 0.3.1, pure Python
#   #    more wheels for the Python 3.12 target if the check below reports them missing, e.g.:
#   EXTRA_WHEELS="grain tokenizers tensorboardX" tpu_gpu_setup/gpu/install.sh --download-wheels
#   # 2. there, from the checkout: wheels into $SITE (default .gpu_site in the checkout), nothing else installed;
#   #    the preinstalled CUDA 13 jax stays (the `gpu` extra would ask for jax[cuda12]):
#   tpu_gpu_setup/gpu/install.sh --offline
#   export PYTHONPATH=$PWD/.gpu_site:$PWD                         # as the script prints
#   python3 -m jaxtrain train --config configs/llama3-1b.yaml
#
# Both end with a check of every runtime import and the devices JAX sees. Then:
#   python3 tpu_gpu_setup/gpu/check_attention.py --quick    # the attention kernels on this GPU
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

case "${1:-}" in
  --download-wheels)
    dest=${2:-.whl}
    mkdir -p "$dest"
    "$PY" -m pip download --no-deps --only-binary=:all: -d "$dest" jax-triton==0.3.1
    if [[ -n "${EXTRA_WHEELS:-}" ]]; then
      # Binary wheels for the target machine's Python, whatever Python runs this script.
      # shellcheck disable=SC2086
      "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" $EXTRA_WHEELS
    fi
    ls -l "$dest"
    exit 0 ;;
  --offline)
    wheels=${2:-.whl}
    SITE=${SITE:-$PWD/.gpu_site}
    shopt -s nullglob
    whl=("$wheels"/*.whl)
    (( ${#whl[@]} )) || { echo "install.sh: no wheels in $wheels (run --download-wheels first)" >&2; exit 2; }
    # --target: no write to the system Python (often externally managed), no dependency resolution.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${whl[@]}"
    # jaxtrain and kernels run from the checkout itself.
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "install.sh: now run: export PYTHONPATH=$SITE:$PWD; python3 -m jaxtrain ..." ;;
  "")
    "$PY" -m pip install -e '.[gpu]' ;;
  *)
    echo "usage: install.sh [--download-wheels [DIR] | --offline [DIR]]   (DIR default .whl)" >&2
    exit 2 ;;
esac

"$PY" - <<'PY'
import importlib
missing = []
for name in ("jax", "flax", "optax", "orbax.checkpoint", "tensorstore", "grain", "yaml", "numpy",
             "tokenizers", "tensorboardX", "jaxtrain", "jaxtrain.kernels"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__})")
print("missing:", ", ".join(missing) if missing else "nothing")
import jax
print(f"jax {jax.__version__}: {jax.device_count()} device(s): {sorted({d.device_kind for d in jax.devices()})}")
try:
    import jax_triton  # noqa: F401  (raises ImportError under a CPU-only jax)
    print("jax_triton: ok")
except Exception as e:  # not fatal: model.attention=auto then uses cudnn or xla
    print(f"jax_triton: unavailable ({type(e).__name__}: {e})")
PY
