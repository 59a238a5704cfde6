#!/bin/bash
# A one-node SLURM cluster on this machine, for running configs/cluster/sbatch.sh under a real
# scheduler (docs/supervision.md, "SLURM and Kubernetes"; tests/cluster/test_slurm.py).
#
#   bash bench/cluster/local_slurm.sh up       # then: export SLURM_CONF=/tmp/megascale-slurm/slurm.conf
#   bash bench/cluster/local_slurm.sh status
#   bash bench/cluster/local_slurm.sh down
#
# Needs root (the daemons run as root, as Debian's slurm-wlm 22.05 does with SlurmUser=root) and,
# the first time, apt-get. Everything it writes is under $MEGASCALE_SLURM_DIR
# (/tmp/megascale-slurm): slurm.conf, its own munge key and socket, state, logs and the pid file of
# every daemon it started. Nothing under /etc or /run is touched: the daemons and the client
# commands find the configuration through SLURM_CONF, and slurm finds munged's socket through
# AuthInfo in it. `up` twice is fine (a daemon already running from here is kept); `down` stops
# only the daemons whose pid files it wrote, after cancelling the jobs they run.
set -euo pipefail

DIR=${MEGASCALE_SLURM_DIR:-/tmp/megascale-slurm}
CONF=$DIR/slurm.conf
MUNGE=$DIR/munge
export SLURM_CONF=$CONF
UP_TIMEOUT_S=${UP_TIMEOUT_S:-30}

die() { echo "error: $*" >&2; exit 2; }

# The pid a daemon wrote, if that process is still alive.
running() { local pid; pid=$(cat "$DIR/$1.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null && echo "$pid"; }

install_if_missing() {
  local missing=() tool
  for tool in munged mungekey slurmctld slurmd sinfo sbatch; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] && return
  if command -v apt-get >/dev/null; then
    echo "installing slurm-wlm and munge with apt-get (about 15 s; missing: ${missing[*]})" >&2
    # A machine whose package lists are stale or absent needs an update first; try without (faster).
    { apt-get install -y -q slurm-wlm munge || { apt-get update -q && apt-get install -y -q slurm-wlm munge; }; } \
      > "$DIR/apt.log" 2>&1 || true
  fi
  missing=()
  for tool in munged mungekey slurmctld slurmd sinfo sbatch; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] || die "SLURM is not installed and could not be: missing ${missing[*]} (apt-get install slurm-wlm munge, as root; see $DIR/apt.log)"
}

write_conf() {
  # This machine's cores and memory. RealMemory a little under MemTotal: a node that reports less
  # memory than configured is drained, and slurmd counts slightly differently from /proc/meminfo.
  local host cpus mem_mb
  host=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)
  cat > "$CONF.partial" <<EOF
# Written by bench/cluster/local_slurm.sh for this machine ($cpus CPUs, ${mem_mb} MB).
ClusterName=megascale-local
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE/socket
SlurmUser=root
# No cgroups needed (containers often have none writable):
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmdSpoolDir=$DIR/slurmd
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.partial" "$CONF"
}

node_state() { sinfo -h -o %T 2>/dev/null | head -1; }

up() {
  [ "$(id -u)" -eq 0 ] || die "local_slurm.sh up needs root (the SLURM daemons run as root)"
  mkdir -p "$DIR" "$MUNGE" "$DIR/slurmd" "$DIR/state"
  chmod 700 "$DIR" "$MUNGE"  # munged refuses a socket or key directory others can write to
  install_if_missing
  if [ -z "$(running munged)" ]; then
    [ -s "$MUNGE/munge.key" ] || mungekey --create --keyfile="$MUNGE/munge.key"
    chmod 400 "$MUNGE/munge.key"
    # --force: as root, and with its socket outside /run/munge.
    munged --force --socket="$MUNGE/socket" --key-file="$MUNGE/munge.key" --pid-file="$DIR/munged.pid" \
      --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed" \
      || die "munged did not start; see $MUNGE/munged.log"
  fi
  if [ -z "$(running slurmctld)" ]; then
    write_conf  # only while nothing reads it: a running cluster keeps its configuration
    # -c: a fresh controller state, no job of an earlier session requeued onto this one.
    slurmctld -c -f "$CONF" || die "slurmctld did not start; see $DIR/slurmctld.log"
  fi
  if [ -z "$(running slurmd)" ]; then
    slurmd -f "$CONF" || die "slurmd did not start; see $DIR/slurmd.log"
  fi
  local waited=0 state
  until state=$(node_state) && [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ]; do
    [ "$waited" -ge "$UP_TIMEOUT_S" ] && die "the node is not idle after ${UP_TIMEOUT_S} s (sinfo: '${state:-no answer}'); see $DIR/slurmctld.log and $DIR/slurmd.log"
    sleep 1
    waited=$((waited + 1))
  done
  echo "SLURM is up: node $(hostname -s) $state ($(nproc) CPUs). Client commands need: export SLURM_CONF=$CONF"
}

down() {
  # Jobs first: their slurmstepd processes would outlive the daemons.
  if [ -n "$(running slurmctld)" ]; then
    scancel --quiet --full --partition=debug 2>/dev/null || true
    local i
    for i in $(seq 20); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  local name pid
  for name in slurmd slurmctld munged; do
    pid=$(running "$name") || continue
    kill "$pid"
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$DIR/$name.pid"
    echo "stopped $name (pid $pid)"
  done
}

status() {
  local name pid
  for name in munged slurmctld slurmd; do
    if pid=$(running "$name"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; fi
  done
  [ -n "$(running slurmctld)" ] && sinfo
  return 0
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: bash bench/cluster/local_slurm.sh up|down|status" >&2; exit 2 ;;
esac
