"""What faults and their recovery cost on this machine: checkpoint saves and restores, a job's
cold start, diagnostics, straggler sensitivity, the supervisor's drills, and the effective
training time ratio (ETTR) of a supervised job under a stream of faults."""
