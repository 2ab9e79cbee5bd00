#!/usr/bin/env bash
# Create a Cloud TPU VM (a single host or a multi-host pod slice) and install jaxtrain on every
# worker. Run on your workstation, from the checkout, with gcloud authenticated:
#
#   export TPU_NAME=jt-v5p ZONE=us-east5-a ACCELERATOR_TYPE=v5p-32 RUNTIME_VERSION=v2-alpha-tpuv5
#   tpu_gpu_setup/tpu/setup_tpu_vm.sh
#
# RUNTIME_VERSION by generation: v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite (ACCELERATOR_TYPE
# v5litepod-N), v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e. Add SPOT=1 for a spot (preemptible) slice.
# Idempotent: an existing TPU is reused; the code is re-copied and re-installed.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5p-8}
RUNTIME_VERSION=${RUNTIME_VERSION:-v2-alpha-tpuv5}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}   # the images' system Python (3.10) is older than jaxtrain needs
cd "$(dirname "$0")/../.."

if ! gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" >/dev/null 2>&1; then
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" ${SPOT:+--spot}
fi

# The committed code (git archive: no runs/, no local venvs), copied to every worker.
archive=$(mktemp --suffix=.tar.gz)
git archive --format=tar.gz -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":~/jaxtrain.tar.gz --zone "$ZONE" --worker=all

# On every worker: uv provides the Python version, jax[tpu] brings libtpu.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  rm -rf ~/jaxtrain && mkdir -p ~/jaxtrain && tar -xzf ~/jaxtrain.tar.gz -C ~/jaxtrain
  command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
  export PATH=\$HOME/.local/bin:\$PATH
  [ -x ~/venv/bin/python ] || uv venv --python $PYTHON_VERSION ~/venv
  uv pip install --python ~/venv/bin/python -e ~/jaxtrain'[tpu]'
  ~/venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.devices()[0].device_kind)'
"
echo "setup_tpu_vm.sh: $TPU_NAME ready; next: tpu_gpu_setup/tpu/launch.sh configs/...yaml [key=value ...]"
