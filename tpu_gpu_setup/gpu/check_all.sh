#!/usr/bin/env bash
# Everything this repository can check on one NVIDIA GPU, in one call, in under 8 minutes:
#   1. jax-triton from carried wheels (offline; install.sh --offline), if any were carried;
#   2. the attention kernels: correctness against XLA and forward/backward TFLOP/s
#      (check_attention.py --quick, ~2-3 min);
#   3. gpu-1b: configs/llama3-1b.yaml on this one GPU, bf16, sequence 4096, with cudnn, triton and
#      xla attention while the budget lasts: tokens/s, MFU and the profile split
#      (bench_gpu_1b.py, ~3-4 min).
# Results (JSON + markdown + logs) go to $OUT when set, else /tmp/gpu_results/<time>/.
#
#   # here, once, with network (jax-triton is not on the lent GPU machine; see check_attention.md):
#   echo /.whl/ >> .git/info/exclude && tpu_gpu_setup/gpu/install.sh --download-wheels
#   # there (carry .whl), from the repository root:
#   bash tpu_gpu_setup/gpu/check_all.sh
#
# Time budget (seconds, each stage is cut by `timeout`): install 60, attention 170, gpu-1b 250.
# A stage that fails or runs out of time does not stop the next one; the exit status is the
# number of stages that failed (0 = all ran).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_results/$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=0
start=$(date +%s)
stage() { echo "== [$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/check_all.log"; }

stage "1/3 install (offline wheels from .whl/, if carried)"
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${SITE:-/tmp/site} timeout 60 tpu_gpu_setup/gpu/install.sh --offline .whl > "$OUT/install.log" 2>&1 \
    || { echo "install failed (see $OUT/install.log)" | tee -a "$OUT/check_all.log"; failed=$((failed + 1)); }
  export PYTHONPATH=${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ wheels carried: the triton implementation will be reported unavailable" | tee -a "$OUT/check_all.log"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/check_all.log"

stage "2/3 attention kernels (check_attention.py --quick)"
timeout 170 "$PY" tpu_gpu_setup/gpu/check_attention.py --quick --budget-s 110 --out "$OUT" 2>&1 | tee "$OUT/check_attention.log"
rc=${PIPESTATUS[0]}; [[ $rc == 0 ]] || { echo "check_attention exit $rc" | tee -a "$OUT/check_all.log"; failed=$((failed + 1)); }

stage "3/3 gpu-1b benchmark (bench_gpu_1b.py)"
timeout 250 "$PY" tpu_gpu_setup/gpu/bench_gpu_1b.py --out "$OUT" --budget-s 170 2>&1 | tee "$OUT/bench_gpu_1b.log"
rc=${PIPESTATUS[0]}; [[ $rc == 0 ]] || { echo "bench_gpu_1b exit $rc" | tee -a "$OUT/check_all.log"; failed=$((failed + 1)); }

stage "done: $failed stage(s) failed; results in $OUT"
ls -l "$OUT" | tee -a "$OUT/check_all.log"
exit "$failed"
