"""Who used this machine's CPUs while a job ran: the job's own processes, everything else, and the
hypervisor (steal), sampled once a second from /proc.

Why: a drill's goodput charges every step the fault-free run's median step, so anything else that
takes the cores for a while reads as the job's loss. The 31-min seed-3 drill
(bench/results/ettr_cpu_30min_seed3.json) ran its steps 35% slower for three spells (steps
1520-1700, 1840-2560, 2700-end), the first 47 steps before any fault, and its goodput fell to 75.5%
against 86.3% fault-free; nothing recorded who took the cores. `CpuLoad` does.

The job is a process tree: the launcher and its descendants. A process's CPU time is its own
(utime + stime) plus that of its children it has reaped (cutime + cstime), so summing over the
live tree keeps the time of workers that ended (the launcher reaps them) — what it misses is a
child that ended and was reaped between two samples by a parent that itself ended then, which
is none of this job's processes. `foreign` is the machine's busy time less the job's: another
user's jobs, this session's own commands, the kernel's threads. A result keeps the summary
and 10-s averages (`binned`).
"""

from __future__ import annotations

import os
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, steal) CPU ticks of the whole machine since boot (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3 onwards): the name is in
    parentheses and may hold spaces. OSError when the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()


def own_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` so far, its own (user + system), not its children's."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICK


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks of it and its reaped children) for every process now."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = stat_fields(int(name))
        except OSError:  # it ended while we looked
            continue
        table[int(name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    return table


def binned(samples: list[dict], seconds: float = 10.0) -> list[list[float]]:
    """`samples` averaged over `seconds` (weighted by each sample's length), as [end t, job,
    foreign, steal] cores: what a result file keeps (a sample a second is ~20k lines of JSON for a
    30-min run)."""
    bins: dict[int, list[dict]] = {}
    for s in samples:
        bins.setdefault(int(s["t"] // seconds), []).append(s)
    rows = []
    for group in bins.values():
        dt = sum(s["dt"] for s in group)
        rows.append([group[-1]["t"], *(round(sum(s[k] * s["dt"] for s in group) / dt, 2)
                                       for k in ("job_cores", "foreign_cores", "steal_cores"))])
    return rows


def tree_ticks(root: int, table: dict[int, tuple[int, int]]) -> int:
    """CPU ticks of `root` and every descendant of it in `table`."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return total


class CpuLoad:
    """Samples, every `every_s` while running, the cores in use by the tree under `root` (the job),
    by everything else (foreign) and by the hypervisor (steal). Use as a context manager."""

    def __init__(self, root: int, every_s: float = 1.0):
        self.root, self.every_s = root, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-load", daemon=True)

    def __enter__(self) -> "CpuLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.time()
        before = (time.time(), *machine_ticks(), tree_ticks(self.root, process_table()))
        stopped = False
        while not stopped:  # the last sample when stopped: the job's end is in it
            stopped = self._stop.wait(self.every_s)
            now = (time.time(), *machine_ticks(), tree_ticks(self.root, process_table()))
            seconds = now[0] - before[0]
            busy, steal, job = ((now[i] - before[i]) / TICK / seconds for i in (1, 2, 3))
            # The job's count can drop when a process it had reaped ends uncounted; never below 0.
            job = max(0.0, job)
            self.samples.append({"t": round(now[0] - start, 1), "dt": seconds, "job_cores": round(job, 2),
                                 "foreign_cores": round(max(0.0, busy - job), 2), "steal_cores": round(steal, 2)})
            before = now

    def summary(self) -> dict:
        """Core-seconds of the job, of everything else and of steal over the samples, and the
        spells (>= 10 s) when others took more than a quarter of a core."""
        def core_s(key):
            return round(sum(s[key] * s["dt"] for s in self.samples), 1)

        spells, start = [], None
        for s in self.samples + [{"t": None, "foreign_cores": 0.0}]:
            busy = s["foreign_cores"] > 0.25
            if busy and start is None:
                start = s["t"]
            elif not busy and start is not None:
                end = self.samples[-1]["t"] if s["t"] is None else s["t"]
                if end - start >= 10:
                    spells.append([start, end])
                start = None
        return {"job_core_s": core_s("job_cores"), "foreign_core_s": core_s("foreign_cores"),
                "steal_core_s": core_s("steal_cores"), "foreign_spells_s": spells,
                "seconds": round(sum(s["dt"] for s in self.samples), 1)}
