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
# There is no driver process: recovery is this script's and the scheduler's. Beside each job step
# runs its watcher (`python -m megascale_jax.supervise.watch`), which reads the tasks' Redis
# heartbeats as the local launcher's supervisor does. When the job step fails (a task died, and
# srun --kill-on-bad-exit ended the others; a stopped task, which JAX's coordination service ends
# the job's processes for once its heartbeats stop for MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S,
# or the watcher once its Redis heartbeats stop for supervisor.hang_timeout_s; a task hung with its
# threads alive — a deadlocked step, a stuck collective — which only the watcher notices, when no
# step advances for that long; a checkpoint one process could not read, which the watcher ends at
# once instead of after SLURM's KillWait), it
# 1. runs the diagnostics on every node of the allocation (`megascale_jax.diagnose --worker`, one
#    per task, bounded by DIAGNOSE_TIMEOUT_S), then `diagnose --collect` appends the nodes found
#    faulty to $RUN_DIR/excluded_hosts.txt (nothing, if no node could report at all);
# 2. when no node was found faulty, starts the tasks again in this allocation, on the same nodes,
#    at most MAX_RESTARTS_IN_ALLOCATION times (3): each resumes from the newest checkpoint in the
#    shared --run-dir, with no wait in the queue (a requeued job waits for SLURM's requeue delay and
#    a new allocation, docs/supervision.md, "Faults under SLURM");
# 3. otherwise excludes every node listed there from the requeued job's allocation (`scontrol
#    update ExcNodeList`), so it never lands on them again, and requeues the job, which resumes
#    from the newest checkpoint.
# scancel (or a preemption) sends SIGTERM: the tasks checkpoint the step in flight and exit; the
# job ends CANCELLED. Submit it again with the same RUN_DIR to resume (the default RUN_DIR names
# the job id, which a new submission does not share).
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
# A hung task (stopped, a wedged host) is noticed by JAX's coordination service only, when its
# heartbeats to it stop for this long: the collectives wait for it without end (JAX's default 100 s).
export MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S=${MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S:-30}

# The config and the task count (SLURM_NTASKS x devices per task against the mesh), checked once
# here before any task starts, in one line: a job step refused for them would say it once per task,
# be diagnosed and be requeued, forever.
python -m megascale_jax.train --config "$CONFIG" --num-processes "$SLURM_NTASKS" --print-config "$@" > /dev/null \
  || exit 2

# Task i's node, for the diagnostics' --collect: SLURM's default (block) distribution puts the first
# tasks on the first node; SLURM_TASKS_PER_NODE is e.g. "2(x3),1".
task_hosts() {
  local nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST")) hosts=() node=0 block count reps i
  local per_node=${SLURM_TASKS_PER_NODE:-}
  for block in ${per_node//,/ }; do
    count=${block%%(*}; reps=1
    [ "$block" != "$count" ] && reps=${block#*(x} && reps=${reps%)}
    for ((i = 0; i < count * reps; i++)); do hosts+=("${nodes[node + i / count]}"); done
    node=$((node + reps))
  done
  [ ${#hosts[@]} -eq "$SLURM_NTASKS" ] || hosts=("${nodes[@]}")  # no SLURM_TASKS_PER_NODE: one task per node
  (IFS=,; echo "${hosts[*]}")
}

lines() { if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }

MAX_RESTARTS_IN_ALLOCATION=${MAX_RESTARTS_IN_ALLOCATION:-3}
restarts=0
while :; do
  # A fresh rendezvous job id for every start: a replay of an earlier join is refused.
  JOB="slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
  [ "$restarts" -gt 0 ] && JOB="$JOB.$restarts"
  status=0
  # The step is named after its job id: the watcher ends it by that name.
  srun --label --kill-on-bad-exit=1 --job-name="$JOB" bash -c '
    exec python -m megascale_jax.train --config "$0" --run-dir "$1" \
      --redis "$2" --job "$3" --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" "${@:4}"
  ' "$CONFIG" "$RUN_DIR" "$REDIS_URL" "$JOB" "$@" &
  srun_pid=$!
  # Beside it, on this node, the step's hang watcher: it reads the tasks' Redis heartbeats and, on a
  # hang or stall (supervisor.hang_timeout_s, the local supervisor's rules), records it in
  # $RUN_DIR/events.jsonl and SIGKILLs the step: srun fails, and the path below takes over.
  python -m megascale_jax.supervise.watch --config "$CONFIG" --run-dir "$RUN_DIR" --redis "$REDIS_URL" \
    --job "$JOB" --nprocs "$SLURM_NTASKS" --restarts "$restarts" "$@" &
  watch_pid=$!
  wait "$srun_pid" || status=$?
  kill "$watch_pid" 2>/dev/null || true
  wait "$watch_pid" 2>/dev/null || true
  [ "$status" -eq 0 ] && exit 0
  echo "sbatch.sh: $(date -u +%T) job step $JOB failed (exit code $status); diagnosing the nodes"
  DIAGNOSE_JOB="$JOB-diagnose"
  srun --label --kill-on-bad-exit=0 timeout "${DIAGNOSE_TIMEOUT_S:-300}" bash -c '
    exec python -m megascale_jax.diagnose --worker --config "$0" --redis "$1" --job "$2" \
      --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" "${@:3}"
  ' "$CONFIG" "$REDIS_URL" "$DIAGNOSE_JOB" "$@" || true
  excluded_before=$(lines "$EXCLUDED")
  python -m megascale_jax.diagnose --collect "$DIAGNOSE_JOB" --redis "$REDIS_URL" --nprocs "$SLURM_NTASKS" \
    --hosts "$(task_hosts)" --excluded-hosts "$EXCLUDED" || true
  # A node found faulty now cannot be left in this allocation: requeue without it.
  [ "$(lines "$EXCLUDED")" -gt "$excluded_before" ] && break
  [ "$restarts" -ge "$MAX_RESTARTS_IN_ALLOCATION" ] && break
  restarts=$((restarts + 1))
  echo "sbatch.sh: $(date -u +%T) no node found faulty: restarting the tasks in this allocation" \
    "($restarts of $MAX_RESTARTS_IN_ALLOCATION)"
done
if [ -s "$EXCLUDED" ]; then
  scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$(sort -u "$EXCLUDED" | paste -sd, -)"
fi
echo "sbatch.sh: $(date -u +%T) requeueing job $SLURM_JOB_ID"
scontrol requeue "$SLURM_JOB_ID"
exit "$status"
