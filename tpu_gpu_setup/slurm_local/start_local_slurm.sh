#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for trying `srun`/`sbatch` recipes and for
# tests/launch/test_slurm.py. Debian/Ubuntu, run as root. Idempotent: run it again at any time; it installs
# what is missing, (re)writes the config, and starts only the daemons that are not running.
#
#   sudo tpu_gpu_setup/slurm_local/start_local_slurm.sh
#   srun -n2 hostname          # two tasks on the one node
#
# Choices (DESIGN.md §6): ProctrackType=proctrack/linuxproc and TaskPlugin=task/none need no cgroups
# (containers often have none writable); SelectType=select/cons_tres with CR_CPU hands out CPUs; the
# daemons run as root (no `slurm` user setup); munged runs as user munge, as munge requires.
set -euo pipefail

[[ $(id -u) -eq 0 ]] || { echo "start_local_slurm.sh: run as root" >&2; exit 2; }

# --- 1. packages (skipped when present) ----------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
    || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# --- 2. munge: a key, then the daemon as user munge -------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  # Debian's postinst usually creates it; make one if not (all nodes of a real cluster share it).
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# --- 3. slurm.conf: one node with this machine's CPUs --------------------------------------------
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))
install -d /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf.new <<EOF
# Written by tpu_gpu_setup/slurm_local/start_local_slurm.sh: a one-node cluster on $HOST.
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
changed=0
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf; then
  mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
  changed=1
else
  rm /etc/slurm/slurm.conf.new
fi

# --- 4. daemons: slurmctld, then slurmd ----------------------------------------------------------
running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if running /run/slurmctld.pid; then
  [[ $changed -eq 1 ]] && scontrol reconfigure
else
  slurmctld
fi
running /run/slurmd.pid || slurmd

# Wait for the node to register; a node left DOWN by an earlier unclean stop is resumed.
for _ in $(seq 100); do
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
  case "$state" in
    idle*|mixed*|allocated*) break ;;
    down*|drain*) scontrol update NodeName="$HOST" State=RESUME || true ;;
  esac
  sleep 0.2
done
sinfo
srun -n1 true && echo "start_local_slurm.sh: SLURM is up ($CPUS CPUs on $HOST); try: srun -n2 hostname"
