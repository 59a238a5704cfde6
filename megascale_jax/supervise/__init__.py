"""The driver side, which must outlive crashing workers and so never imports jax: `launch` (the
CLI), `supervisor` (detect, diagnose, restart), `workers` (local worker processes),
`redis_server` (the embedded Redis), `diagnose` (device and collective self-tests; only its
worker half, run in a child process, imports jax)."""
