#!/bin/bash
# One pod of configs/cluster/jobset.yaml: diagnostics before training, then training.
#
#   bash configs/cluster/jobset_worker.sh CONFIG [overrides...]
#
# The JobSet gives every pod REDIS_URL, RUN_DIR, NUM_PROCESSES, its completion index
# (JOB_COMPLETION_INDEX), the set's name and restart attempt, and the node it runs on (NODE_NAME);
# the Redis password comes from a Secret, as the file MEGASCALE_REDIS_PASSWORD_FILE names (never
# on a command line: `ps` shows those to every user of the node).
# 1. `python -m megascale_jax.preflight` runs the device and collective checks on all pods
#    together. A node found faulty (or already listed in RUN_DIR/excluded_hosts.txt) is appended
#    to that file (an `evict` event in RUN_DIR/events.jsonl) and labelled
#    megascale-jax/excluded=true, which the pods' node affinity avoids;
#    the pod on it exits 3, so the JobSet restarts the whole set, off that node. Checks that could
#    not run (Redis, the rendezvous) exclude nobody and exit 1: the set restarts as it was.
# 2. Training resumes from the newest checkpoint on the shared volume.
set -euo pipefail
if [ -z "${MEGASCALE_REDIS_PASSWORD_FILE:-}${MEGASCALE_REDIS_PASSWORD:-}" ]; then
  echo "error: the job's Redis needs a password: set MEGASCALE_REDIS_PASSWORD_FILE to a file holding it (a Secret volume)" >&2
  exit 2
fi
CONFIG=${1:?usage: jobset_worker.sh CONFIG [overrides...]}
shift
JOB="$JOBSET_NAME-$JOBSET_RESTART_ATTEMPT"

timeout "${PREFLIGHT_TIMEOUT_S:-900}" python -m megascale_jax.preflight --config "$CONFIG" "$@" \
  --redis "$REDIS_URL" --job "$JOB-preflight" \
  --num-processes "$NUM_PROCESSES" --process-id "$JOB_COMPLETION_INDEX" \
  --host "$NODE_NAME" --run-dir "$RUN_DIR" \
  --exclude-command "kubectl label node --overwrite {host} megascale-jax/excluded=true"

exec python -m megascale_jax.train --config "$CONFIG" "$@" --run-dir "$RUN_DIR" \
  --redis "$REDIS_URL" --job "$JOB" \
  --num-processes "$NUM_PROCESSES" --process-id "$JOB_COMPLETION_INDEX"
