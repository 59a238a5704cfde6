"""The worker side of a cluster job: `rendezvous` (Redis: ranks, barriers, key names, the signed
coordinator record), `redis_auth` (the job's Redis password, URLs safe to print), `heartbeat` (the
worker's heartbeat thread), `faults` (drills injected through the environment)."""
