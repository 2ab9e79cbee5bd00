#!/usr/bin/env bash
# Start `jaxtrain train` on every worker of a TPU VM / pod slice: one process per worker (host).
# Run on your workstation after setup_tpu_vm.sh:
#
#   export TPU_NAME=jt-v5p ZONE=us-east5-a
#   tpu_gpu_setup/tpu/launch.sh configs/llama3-8b.yaml run.output_dir=gs://my-bucket/runs/8b
#   tpu_gpu_setup/tpu/launch.sh --logs      # follow worker 0's log
#   tpu_gpu_setup/tpu/launch.sh --stop      # SIGTERM: emergency checkpoint, exit 75
#
# Every worker gets the job's coordinates explicitly (JAXTRAIN_COORDINATOR = worker 0's internal
# IP, JAXTRAIN_NUM_PROCESSES = number of workers, JAXTRAIN_PROCESS_ID = its worker number from the
# metadata server), so jaxtrain.runtime.distributed forms one job without relying on auto-detection.
# Use a gs:// run.output_dir (or a shared filesystem): every worker writes its checkpoint shards there.
# Training runs under nohup, so it survives the ssh session; output goes to ~/train.log per worker.
# No supervisor here: after a crash or preemption run the same command again and the job resumes
# from the latest checkpoint (for automatic restarts use GKE with ../kubernetes/jobset.yaml).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker="$1" --command "$2"; }

case "${1:-}" in
  --logs) exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=0 --command "tail -n 100 -f ~/train.log" ;;
  --stop) ssh_all all "[ -s ~/train.pid ] && kill -TERM \$(cat ~/train.pid) || true"; exit 0 ;;
  "" | -*) echo "usage: launch.sh CONFIG [key=value ...] | --logs | --stop" >&2; exit 2 ;;
esac

IPS=($(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" \
       --format='value[delimiter=" "](networkEndpoints[].ipAddress)'))
COORDINATOR="${IPS[0]}:${COORDINATOR_PORT:-8476}"
ARGS=$(printf '%q ' "$@")   # CONFIG and overrides, quoted for the remote shell
METADATA=http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number

ssh_all all "
  cd ~/jaxtrain
  export JAXTRAIN_COORDINATOR=$COORDINATOR JAXTRAIN_NUM_PROCESSES=${#IPS[@]}
  export JAXTRAIN_PROCESS_ID=\$(curl -s -H 'Metadata-Flavor: Google' $METADATA)
  nohup ~/venv/bin/python -m jaxtrain train --config $ARGS > ~/train.log 2>&1 < /dev/null &
  echo \$! > ~/train.pid
  echo \"worker \$JAXTRAIN_PROCESS_ID started (pid \$!), coordinator $COORDINATOR\"
"
