#!/bin/bash
# SLURM: one megascale_jax.train worker per node (all of the node's GPUs), rendezvous and
# heartbeats through an external Redis that requires a password, over TLS.
#
#   export REDIS_URL='rediss://megascale@redis.example:6380?ssl_ca_certs=/shared/redis/ca.crt'
#   export MEGASCALE_REDIS_PASSWORD_FILE=$HOME/.megascale/redis-password   # chmod 600
#   sbatch configs/cluster/sbatch.sh configs/gpt_1b.yaml mesh.dp=16
#
# The password travels in the environment (srun passes it on), never on a command line, where `ps`
# would show it to every user of the nodes; a URL holding one is refused. `megascale@` names the
# job's Redis ACL user; plain redis://HOST:PORT works too when the server has only a requirepass
# password. Whoever lacks the password cannot reach the job's keys, and the coordinator record the
# workers meet at is signed with it (docs/supervision.md, "Who may talk to the job's Redis").
# Every worker gets the same job id ($SLURM_JOB_ID) and its rank from SLURM_PROCID, joins through
# Redis, learns rank 0's coordinator address there and starts jax.distributed with it. (Without
# --redis, `jax.distributed.initialize()` with no arguments auto-detects SLURM itself — cluster
# auto-detection also covers Kubernetes/GKE and Open MPI — but then there are no heartbeats.)
# Recovery on a cluster is the scheduler's: when the job step fails, this script
# 1. runs the diagnostics on every node of the allocation (`megascale_jax.diagnose --worker`, one
#    per node, bounded by DIAGNOSE_TIMEOUT_S), then `diagnose --collect` appends the nodes found
#    faulty to $RUN_DIR/excluded_hosts.txt (nothing, if no node could report at all);
# 2. excludes every node listed there from the requeued job's allocation (`scontrol update
#    ExcNodeList`), so it never lands on them again;
# 3. requeues the job, which resumes from the newest checkpoint in the shared --run-dir.
#SBATCH --job-name=megascale-jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --requeue
# In the submission directory: SLURM creates no directory for it, and a job whose output file cannot be
# opened fails at launch without a line anywhere (a `logs/` that does not exist did). Every task
# writes here, each line prefixed with its rank (srun --label).
#SBATCH --output=%x-%j.log
set -euo pipefail
: "${REDIS_URL:?set REDIS_URL=rediss://[USER@]host:port?ssl_ca_certs=/path/ca.crt (or redis://[USER@]host:port)}"
# Checked here, not by every worker: a job step that fails is diagnosed and requeued, forever.
if [ -z "${MEGASCALE_REDIS_PASSWORD_FILE:-}${MEGASCALE_REDIS_PASSWORD:-}" ]; then
  echo "error: the job's Redis needs a password: set MEGASCALE_REDIS_PASSWORD_FILE to a file (chmod 600) holding it" >&2
  exit 2
fi
CONFIG=${1:?usage: sbatch sbatch.sh CONFIG [overrides...]}
shift
RUN_DIR=${RUN_DIR:-/shared/runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}

EXCLUDED="$RUN_DIR/excluded_hosts.txt"

# The config and the task count (SLURM_NTASKS x devices per task against the mesh), checked once
# here before any task starts, in one line: a job step refused for them would say it once per task,
# be diagnosed and be requeued, forever.
python -m megascale_jax.train --config "$CONFIG" --num-processes "$SLURM_NTASKS" --print-config "$@" > /dev/null \
  || exit 2

status=0
srun --label --kill-on-bad-exit=1 bash -c '
  exec python -m megascale_jax.train --config "$0" --run-dir "$1" \
    --redis "$2" --job "slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" \
    --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" "${@:3}"
' "$CONFIG" "$RUN_DIR" "$REDIS_URL" "$@" || status=$?
if [ "$status" -ne 0 ]; then
  DIAGNOSE_JOB="slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}-diagnose"
  srun --label --kill-on-bad-exit=0 timeout "${DIAGNOSE_TIMEOUT_S:-300}" bash -c '
    exec python -m megascale_jax.diagnose --worker --config "$0" --redis "$1" --job "$2" \
      --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" "${@:3}"
  ' "$CONFIG" "$REDIS_URL" "$DIAGNOSE_JOB" "$@" || true
  # One task per node, so rank i ran on the i-th node of the allocation.
  python -m megascale_jax.diagnose --collect "$DIAGNOSE_JOB" --redis "$REDIS_URL" --nprocs "$SLURM_NTASKS" \
    --hosts "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)" --excluded-hosts "$EXCLUDED" || true
  if [ -s "$EXCLUDED" ]; then
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$(sort -u "$EXCLUDED" | paste -sd, -)"
  fi
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
