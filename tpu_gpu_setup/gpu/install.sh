#!/usr/bin/env bash
# Install jaxtrain for NVIDIA GPUs. Run from anywhere inside a checkout.
#
# Online (a normal GPU host: Python >= 3.11, NVIDIA driver for CUDA 12), into the active virtualenv:
#   python3 -m venv ~/venv && source ~/venv/bin/activate
#   tpu_gpu_setup/gpu/install.sh
#   # = pip install -e '.[gpu]'   (jax[cuda12] with its CUDA wheels, jax-triton, triton)
#
# Offline (the lent H200 machine: Python 3.12 with jax 0.11.2 for CUDA 13, flax, optax, orbax,
# tensorstore and triton 3.6 preinstalled, no network, no jax-triton; see DESIGN.md §6):
#   # 1. here, with network: put wheels into the checkout (jax-triton is pure Python)
#   tpu_gpu_setup/gpu/install.sh --download-wheels wheels/
#   #    more wheels for the Python 3.12 target if its check (below) says they are missing, e.g.:
#   EXTRA_WHEELS="grain tokenizers tensorboardX" tpu_gpu_setup/gpu/install.sh --download-wheels wheels/
#   # 2. there (wheels/ travels with the working tree):
#   tpu_gpu_setup/gpu/install.sh --offline wheels/
#   # = pip install --no-deps --no-index wheels/*.whl, then jaxtrain itself without dependencies:
#   #   --no-deps keeps the preinstalled CUDA 13 jax (the `gpu` extra would ask for jax[cuda12]).
#   # A system Python that refuses pip (externally-managed-environment): PIP_BREAK_SYSTEM_PACKAGES=1.
#
# Both end with a check of every runtime import and the devices JAX sees. Then:
#   python3 tpu_gpu_setup/gpu/check_attention.py --quick    # the attention kernels on this GPU
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

case "${1:-}" in
  --download-wheels)
    dest=${2:?usage: install.sh --download-wheels DIR}
    mkdir -p "$dest"
    "$PY" -m pip download --no-deps --only-binary=:all: -d "$dest" jax-triton
    if [[ -n "${EXTRA_WHEELS:-}" ]]; then
      # Binary wheels for the target machine's Python, whatever Python runs this script.
      # shellcheck disable=SC2086
      "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" $EXTRA_WHEELS
    fi
    ls -l "$dest"
    exit 0 ;;
  --offline)
    wheels=${2:?usage: install.sh --offline DIR}
    shopt -s nullglob
    whl=("$wheels"/*.whl)
    (( ${#whl[@]} )) && "$PY" -m pip install --no-deps --no-index "${whl[@]}"
    # jaxtrain itself. An editable install needs setuptools>=68 and wheel already present (no
    # network for build isolation); failing that, a .pth file puts the checkout on sys.path (then
    # use `python3 -m jaxtrain.cli ...` since no `jaxtrain` script is installed).
    if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . >/tmp/jaxtrain-pip.log 2>&1; then
      purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      echo "$PWD" > "$purelib/jaxtrain-checkout.pth"
      echo "install.sh: pip install -e . failed (/tmp/jaxtrain-pip.log); wrote $purelib/jaxtrain-checkout.pth instead"
    fi ;;
  "")
    "$PY" -m pip install -e '.[gpu]' ;;
  *)
    echo "usage: install.sh [--download-wheels DIR | --offline DIR]" >&2
    exit 2 ;;
esac

"$PY" - <<'PY'
import importlib
missing = []
for name in ("jax", "flax", "optax", "orbax.checkpoint", "tensorstore", "grain", "yaml", "numpy",
             "tokenizers", "tensorboardX", "jaxtrain", "kernels"):
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
