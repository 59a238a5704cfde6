"""The driver side, which must outlive crashing workers and so never imports jax: `launch` (the
CLI), `supervisor` (the attempt loop: run, detect, decide, recover), `detect` (faults, heartbeats,
stragglers), `policy` (the recovery decision, a pure function), `transport` (the driver's Redis
link, kept alive), `events` (RUN_DIR/events.jsonl), `workers` (local worker processes),
`placement` (slots, spares, shrinking), `drills` (faults injected on purpose), `redis_server`
(the embedded Redis), `diagnose` (device and collective self-tests; only its worker half, run in
a child process, imports jax)."""
