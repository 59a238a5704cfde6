"""The worker side of a cluster job: `rendezvous` (Redis: ranks, barriers, key names),
`heartbeat` (the worker's heartbeat thread), `faults` (drills injected through the environment)."""
