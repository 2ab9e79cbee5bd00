#!/usr/bin/env bash
# Everything this repository can check on one NVIDIA GPU, in one call, in under 7 minutes:
#   1. jax-triton from carried wheels (offline; install.sh --offline), if any were carried;
#   2. `import jax` and the devices it sees (if this fails, stages 3 and 4 cannot run: skipped);
#   3. the attention kernels: correctness against XLA and forward/backward TFLOP/s
#      (check_attention.py --quick, ~2 min);
#   4. gpu-1b: configs/llama3-1b.yaml on this one GPU, bf16, sequence 4096, with cudnn, triton and
#      xla attention while the budget lasts: tokens/s, MFU and the profile split
#      (bench_gpu_1b.py, ~3-4 min).
# Results (JSON + markdown + logs) go to $OUT when set, else gpu_results/<time>/ in the checkout.
#
#   # here, once, with network (jax-triton is not on the lent GPU machine; see check_attention.md):
#   echo /.whl/ >> .git/info/exclude && tpu_gpu_setup/gpu/install.sh --download-wheels
#   # there (carry .whl), from the repository root:
#   bash tpu_gpu_setup/gpu/check_all.sh
#
# Time budget. A caller (the lent machine's one command) allows 480 s in all, so the whole script
# keeps to TOTAL_S = 400 s: every step runs under `timeout` (plus 5 s to kill a step that ignores
# SIGTERM), with at most install 44 s, the jax check 30 s, attention 140 s; gpu-1b gets what is
# left less 10 s for the summary (at least 400 - 44 - 30 - 140 - 3 x 5 - 10 = 161 s, typically
# 240 s, its cap). Each Python stage is told a smaller budget for starting new work
# (attention 60%, gpu-1b 2/3 of its timeout) so that it normally ends on its own and writes its
# results; `timeout` only catches a hang. The caps are shares of TOTAL_S, so a test can run the
# same logic on a total of a few seconds. A stage that fails or runs out of time does not stop
# the next one; the exit status is the number of stages that failed or were skipped (0 = all ran).
#
# Overrides (for tests, or a machine with a different Python):
#   JAXTRAIN_GPU_CHECK_PYTHON   the interpreter for every step (default $PYTHON, else python3);
#                               install.sh gets it as PYTHON, so wheels go to the Python that runs
#   JAXTRAIN_GPU_CHECK_WHEELS   the directory of carried wheels (default .whl)
#   JAXTRAIN_GPU_CHECK_TOTAL_S  the whole script's budget in seconds (default 400)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_results/$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
PY=${JAXTRAIN_GPU_CHECK_PYTHON:-${PYTHON:-python3}}
WHEELS=${JAXTRAIN_GPU_CHECK_WHEELS:-.whl}
SITE=${SITE:-$PWD/.gpu_site}
TOTAL_S=${JAXTRAIN_GPU_CHECK_TOTAL_S:-400}
KILL_AFTER_S=5  # after SIGTERM, SIGKILL this much later (a process stuck in a CUDA call may ignore TERM)
failed=0
start=$(date +%s)
log() { echo "$*" | tee -a "$OUT/check_all.log"; }
stage() { log "== [$(( $(date +%s) - start )) s] $*"; }

# share PER_MILLE: that share of TOTAL_S in whole seconds, at least 1 (timeout 0 would mean "none").
share() { local s=$(( TOTAL_S * $1 / 1000 )); (( s < 1 )) && s=1; echo "$s"; }
INSTALL_CAP=$(share 110)    # 44 s of 400
JAX_CAP=$(share 75)         # 30 s
ATTENTION_CAP=$(share 350)  # 140 s
GPU1B_CAP=$(share 600)      # 240 s
WRAP_UP=$(share 25)         # 10 s kept for the listing at the end

# stage_timeout CAP: CAP seconds, or fewer if the total budget (less the wrap-up) has less left.
stage_timeout() {
  local left=$(( start + TOTAL_S - WRAP_UP - $(date +%s) ))
  (( left < $1 )) && echo "$left" || echo "$1"
}

# run_stage NAME LOGFILE CAP COMMAND...: COMMAND under timeout, output to LOGFILE and the console;
# a failure or timeout is counted and said in check_all.log. Sets STAGE_TIMEOUT before running
# (callers that pass a budget to their script compute it from the same number).
run_stage() {
  local name=$1 logfile=$2 t=$3; shift 3
  if (( t < 1 )); then
    log "$name skipped: no time left in the ${TOTAL_S} s budget"; failed=$((failed + 1)); return 1
  fi
  log "($name: timeout ${t} s)"
  timeout -k "$KILL_AFTER_S" "$t" "$@" 2>&1 | tee "$logfile"
  local rc=${PIPESTATUS[0]}
  if [[ $rc == 124 || $rc == 137 ]]; then
    log "$name ran out of its ${t} s (exit $rc; see $logfile)"; failed=$((failed + 1)); return 1
  elif [[ $rc != 0 ]]; then
    log "$name exit $rc (see $logfile)"; failed=$((failed + 1)); return 1
  fi
  return 0
}

stage "1/4 install (offline wheels from $WHEELS/, if carried)"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  # PYTHON: the wheels go to (and install.sh's import check runs in) the Python that runs the stages.
  run_stage install "$OUT/install.log" "$(stage_timeout "$INSTALL_CAP")" \
    env PYTHON="$PY" SITE="$SITE" tpu_gpu_setup/gpu/install.sh --offline "$WHEELS"
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  log "no $WHEELS/ wheels carried: the triton implementation will be reported unavailable"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

stage "2/4 jax and its devices"
if run_stage jax "$OUT/jax_check.log" "$(stage_timeout "$JAX_CAP")" \
    "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"; then
  cat "$OUT/jax_check.log" >> "$OUT/check_all.log"
  jax_ok=1
else
  jax_ok=0
fi

stage "3/4 attention kernels (check_attention.py --quick)"
if (( jax_ok )); then
  t=$(stage_timeout "$ATTENTION_CAP")
  run_stage check_attention "$OUT/check_attention.log" "$t" \
    "$PY" tpu_gpu_setup/gpu/check_attention.py --quick --budget-s $(( t * 60 / 100 )) --out "$OUT"
else
  log "check_attention skipped: jax did not start (see $OUT/jax_check.log)"; failed=$((failed + 1))
fi

stage "4/4 gpu-1b benchmark (bench_gpu_1b.py)"
if (( jax_ok )); then
  t=$(stage_timeout "$GPU1B_CAP")
  run_stage bench_gpu_1b "$OUT/bench_gpu_1b.log" "$t" \
    "$PY" tpu_gpu_setup/gpu/bench_gpu_1b.py --out "$OUT" --budget-s $(( t * 2 / 3 ))
else
  log "bench_gpu_1b skipped: jax did not start (see $OUT/jax_check.log)"; failed=$((failed + 1))
fi

stage "done: $failed stage(s) failed or skipped; results in $OUT"
ls -l "$OUT" | tee -a "$OUT/check_all.log"
exit "$failed"
