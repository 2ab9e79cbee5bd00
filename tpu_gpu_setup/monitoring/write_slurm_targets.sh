#!/usr/bin/env bash
# Write Prometheus file_sd targets for the current SLURM job: every node of the job, ports
# PORT .. PORT + TASKS_PER_NODE - 1 (jaxtrain serves observe.prometheus_port + local index).
#   write_slurm_targets.sh PORT TASKS_PER_NODE DIR   ->   DIR/<jobid>.json (written atomically)
# Remove the file when the job ends (or let JaxtrainEndpointDown say so).
set -euo pipefail
port=${1:?port}; per_node=${2:?tasks per node}; dir=${3:?targets dir}
job=${SLURM_JOB_ID:?not inside a SLURM job}
mkdir -p "$dir"
targets=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  for ((i = 0; i < per_node; i++)); do targets+=("\"$node:$((port + i))\""); done
done
tmp=$(mktemp "$dir/.$job.XXXXXX")
printf '[{"targets": [%s], "labels": {"slurm_job": "%s"}}]\n' "$(IFS=,; echo "${targets[*]}")" "$job" > "$tmp"
mv "$tmp" "$dir/$job.json"
