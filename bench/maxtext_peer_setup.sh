#!/usr/bin/env bash
# Separate Python 3.12 venv with MaxText 0.2.5 from PyPI, for bench/vs_maxtext.py (DESIGN §6).
# No MaxText source lives in this repository. ~5.5 min and ~2.8 GB on the 2-core bench machine.
#   bash bench/maxtext_peer_setup.sh [VENV=../maxtext-venv] [PYTHON=python3.12]
set -euo pipefail
VENV=${1:-../maxtext-venv}
PYTHON=${2:-python3.12}
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q "maxtext[tpu]==0.2.5"   # the base package declares no deps; [tpu] brings jax, flax, optax, ...
JAX_PLATFORMS=cpu "$VENV/bin/python" -c "import importlib.metadata as m, jax, maxtext; print('maxtext', m.version('maxtext'), 'jax', jax.__version__, jax.devices())"
echo "installed in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
