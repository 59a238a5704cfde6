"""Effective training time ratio (ETTR) of a supervised job under a stream of faults, on this machine.

    python -m bench.resilience.ettr [--minutes 30] [--nprocs 4] [--spares 2] [--fault-every 120 300] [--seed 0]
    python -m bench.resilience.ettr --reference-for bench/results/ettr_cpu.json  # step 2 of a --no-reference run
    python -m bench.resilience.ettr --reference-for SEED1.json --reference-from SEED0.json  # the same job's, borrowed
    python -m bench.resilience.ettr --recount bench/results/ettr_cpu.json        # per-fault rows and budget again

1. Calibrate: a short fault-free launch measures the step time (or `--step-s` gives it), which
   sets `train.steps` so the drilled run lasts about `--minutes`, and `checkpoint.every` so a
   checkpoint comes every <= `--checkpoint-s` seconds of training (and, with `--snapshot-s`, a
   memory snapshot every <= that many: `checkpoint.memory_every`, training/snapshot.py).
2. Reference: the same job without faults (skip with `--no-reference`): its ETTR is what start-up,
   compilation and checkpoints cost alone, and its final loss is the one to reproduce.
3. Drilled: `python -m megascale_jax.launch --nprocs N --spares K` with a fault every U(a, b)
   seconds, the kinds in a seeded shuffled cycle: kill -9, SIGSTOP (a hang), a slow rank (a
   straggler, evicted), a faulty rank (fails diagnostics, evicted), a lost host (a faulty rank
   whose memory snapshots are wiped too: its spare restores from a peer's copy), a killed Redis, a corrupted
   newest checkpoint (plus a kill, so the restart must fall back), a transient NaN. The faults
   are the launcher's own `--drill KIND:RANK@tSECONDS`.

ETTR = productive step time / wall time: the step times of the steps in the final metrics.jsonl
(each step once: work redone after a restart is not productive; start-up, compilation,
checkpoint blocking and evaluation are not in a step's time) over the launcher's wall time. Per
fault kind: detection latency, fault to training resumed, steps lost. And the budget of the rest:
start-up, checkpoint blocking, recovery, redone steps, other (`budget`). The final loss is compared with the
reference: equal bitwise when the job kept its data-parallel size; after a shrink (fewer
replicas, more microbatches) the reduction order changes, so the relative difference is reported.
Writes bench/results/ettr_cpu.json.
"""

import glob
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from bench.common import Bench
from bench.resilience.cpu_load import CpuLoad, binned
from megascale_jax import run_dir as run_dirs

KINDS = ("kill", "stop", "slow", "faulty", "host", "redis", "corrupt", "nan")
RANKLESS = ("redis", "corrupt")
# A model whose step takes ~1 s on 4 CPU processes of this 2-core machine; stragglers are judged
# over 10-step windows every 5 s, and a straggler is evicted (its slot excluded, a spare promoted).
# The eviction threshold is 20% of a step: at the default 5% a healthy rank of 4 sharing 2 cores
# crossed it by noise (a false eviction in the first drilled run); the slow drill is 50%. The stall
# floor (no step for that long while heartbeats go on) stays 10 s: the 20-min run had steps of 6-8 s
# (restarts and the slow drill), which a 6 s floor would have called stalls. Heartbeat silence is
# judged apart: 2 s, eight heartbeats of 0.25 s (4 s at 1 s before 2026-11-29; the longest silence
# of a rank that went on training was 0.71 s in a 5.6-min drill with a fault every 30 s and the
# standby imports after each restart: bench/results/ettr_cpu_6min_hang.json). Stragglers are checked
# every 2 s (was 5 s: the slow drill waited 2.5 s on average for the next check after its window had
# filled). Checkpoints copy on the device and write in the background
# (checkpoint.background_host_copy): a save blocked 0.08-0.16 s with orbax's own host copy, 1.6 ms
# (median, ettr_cpu_30min.json) this way, which lets checkpoints come often enough that a damaged
# newest one (the corrupt drill) costs seconds of redone steps, not a minute.
MODEL = ["train.eval_every=0", "model.layers=4", "model.d_model=256", "model.seq_len=128", "train.global_batch=16",
         "mesh.tp=1", "mesh.pp=1", "supervisor.max_restarts=100", "supervisor.evict_stragglers=true",
         "supervisor.straggler_check_s=2", "observe.straggler_window=10", "observe.straggler_threshold=0.2",
         "supervisor.heartbeat_s=0.25", "supervisor.hang_timeout_s=2", "supervisor.stall_floor_s=10",
         "checkpoint.background_host_copy=true"]


def launch(run_dir: str, nprocs: int, args: list[str], drills: list[str] = (), spares: int = 0,
           checkout: str | None = None, sample_s: float = 1.0) -> tuple[float, float, CpuLoad]:
    """Run a supervised job to its end; (its start as time.time(), its wall time in seconds, who
    used the CPUs meanwhile, sampled every `sample_s`). `checkout`: run another checkout's
    megascale_jax (from a neutral directory: `python -m` puts the working directory first)."""
    command = [sys.executable, "-m", "megascale_jax.launch", "--nprocs", str(nprocs), "--spares", str(spares),
               "--run-dir", run_dir, *[f"--drill={d}" for d in drills], *MODEL, f"mesh.dp={nprocs}",
               f"mesh.cpu_devices={nprocs}", *args]
    print("$", " ".join(command[1:]), flush=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **({"PYTHONPATH": checkout} if checkout else {})}
    start = time.time()
    process = subprocess.Popen(command, env=env, cwd=tempfile.gettempdir() if checkout else None,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with CpuLoad(process.pid, sample_s) as load:
        output, _ = process.communicate()
    wall = time.time() - start
    with open(os.path.join(run_dir, "launcher.log"), "w") as f:
        f.write(output)
    if process.returncode != 0:
        raise SystemExit(f"launch failed ({process.returncode}); see {run_dir}/launcher.log:\n{output[-3000:]}")
    return start, wall, load


def load_record(load: CpuLoad) -> dict:
    """What a result keeps of a run's CPU samples: the summary, and the cores every 10 s."""
    return {**load.summary(), "every_10s_t_job_foreign_steal": binned(load.samples)}


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def productive(run_dir: str) -> tuple[float, list[dict]]:
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "a step missing or twice"
    return sum(r["step_time_s"] for r in records), records


def every_rank_training_at(event: dict | None) -> float | None:
    """When every rank of the attempt a `started` or `resumed` event reports was training (its
    step clock running): that attempt's launch plus the supervisor's `phases_s["training"]`. The
    event itself comes a step later, and that step is productive (in metrics.jsonl): counting up
    to the event would count the step twice. None without the phases."""
    phases = (event or {}).get("phases_s") or {}
    if "training" not in phases:
        return None
    if "since_launch_s" in event:  # started: timed from the launch
        launched = event["time"] - event["since_launch_s"]
    elif "relaunched_after_fault_s" in event:  # resumed: both timed from the same fault
        launched = event["time"] - event["since_fault_s"] + event["relaunched_after_fault_s"]
    else:
        return None
    return launched + phases["training"]


def mean_fault_interval_s(result: dict) -> float:
    """The drill schedule's mean seconds between faults (uniform over --fault-every)."""
    return sum(result["fault_every_s"]) / 2


def consequences(events: list[dict]) -> list[dict]:
    """Per drill: what it cost, from the events up to the next drill."""
    out = []
    drills = [i for i, e in enumerate(events) if e["kind"] == "drill"]
    for n, i in enumerate(drills):
        drill, after = events[i], events[i + 1:drills[n + 1] if n + 1 < len(drills) else len(events)]

        def first(kind, **fields):
            return next((e for e in after if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items())), None)

        row = {"kind": drill["drill"], "rank": drill.get("rank"), "at_step": drill["step"], "time": drill["time"]}
        fault, resumed, restart = first("fault"), first("resumed"), first("restart")
        if drill["drill"] == "nan":
            triage = first("nan_triage")
            row.update(detected_s=triage and triage["time"] - drill["time"], outcome=triage and triage["outcome"],
                       resumed_s=None, steps_lost=0)
        elif drill["drill"] == "redis":
            back = first("redis_restart")
            row.update(detected_s=back and back["latency_s"], resumed_s=back and back["restart_s"], steps_lost=0)
        else:
            flagged = first("straggler") if drill["drill"] == "slow" else fault
            # Steps lost: from the fault back to where training really resumed (a damaged newest
            # checkpoint makes that an older one than the restart planned).
            lost = restart and restart["steps_lost"]
            if fault and resumed and "from_step" in resumed:
                lost = max(0, fault["step"] - resumed["from_step"])
            row.update(detected_s=flagged and (flagged["time"] - drill["time"] if drill["drill"] == "slow"
                                               else flagged["latency_s"]),
                       # from the drill, not from the last fault: a damaged checkpoint takes two
                       # attempts (the second fault is the first restore's), and they are one recovery
                       resumed_s=resumed and resumed["time"] - drill["time"], steps_lost=lost,
                       cause=fault and fault["cause"],
                       # the restart's anatomy: fault -> relaunched (detection, diagnostics, teardown),
                       # then the launch -> every rank beating, restored, compiled (supervisor events)
                       relaunched_s=resumed and resumed.get("relaunched_after_fault_s"),
                       diagnosis_s=(diagnosis := first("diagnosis")) and diagnosis["duration_s"],
                       restart_phases_s=resumed and resumed.get("phases_s"),
                       training_s=(training := every_rank_training_at(resumed)) and training - drill["time"])
        # What the driver judged it to be (supervise/verdict.py: the events carrying a `verdict`, in
        # order; a damaged checkpoint is judged twice, its kill and then the damage) and which slots it
        # excluded, each with why (issue 64 items 4 and 5).
        evictions = [{"rank": e["rank"], "host": e["host"], "reason": e["reason"]} for e in after if e["kind"] == "evict"]
        row.update(verdicts=[e["verdict"] for e in after if "verdict" in e], evictions=evictions,
                   evicted=bool(evictions), promoted=bool(first("spare_promoted")), shrunk=bool(first("shrink")))
        out.append(row)
    return out


def undrilled_faults(events: list[dict]) -> list[dict]:
    """Faults no drill caused (`consequences` takes the first fault after each drill): a false
    alarm or a real fault of the machine; each with what it cost, fault to training resumed. A
    fault during the recovery from another (before training resumed: the damaged checkpoint's
    second attempt) is part of that recovery, not a fault of its own."""
    out, drilled_since, recovering = [], False, False
    for i, e in enumerate(events):
        if e["kind"] == "drill":
            drilled_since = True
        elif e["kind"] == "resumed":
            recovering = False
        elif e["kind"] == "fault":
            caused = drilled_since or recovering
            drilled_since, recovering = False, True
            if caused:
                continue
            resumed = next((r for r in events[i + 1:] if r["kind"] == "resumed"), None)
            out.append({"cause": e["cause"], "rank": e["rank"], "step": e["step"], "detail": e.get("detail"),
                        "resumed_s": resumed and resumed["since_fault_s"]})
    return out


PHASES = re.compile(r"start-up phases: (.*)")
ATTEMPT = re.compile(r"^===== attempt (\d+),", re.MULTILINE)


def startup_phases(run_dir: str) -> list[dict]:
    """Per attempt, seconds in each start-up phase of train.py (its `start-up phases:` line),
    the slowest process's: the one every other waits for in the first step's collectives."""
    attempts: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "worker*.log"))):
        with open(path) as f:
            text = f.read()
        starts = list(ATTEMPT.finditer(text))
        for n, start in enumerate(starts):
            segment = text[start.end():starts[n + 1].start() if n + 1 < len(starts) else len(text)]
            if line := PHASES.search(segment):
                slowest = attempts.setdefault(int(start.group(1)), {})
                for part in line.group(1).split(", "):
                    phase, seconds = part.rsplit(" ", 1)
                    slowest[phase] = max(slowest.get(phase, 0.0), float(seconds.removesuffix("s")))
    return [{"attempt": a, **{k: round(v, 2) for k, v in phases.items()}} for a, phases in sorted(attempts.items())]


def add_restore_sources(run_dir: str, events: list[dict], rows: list[dict]) -> None:
    """Each drill row's `restore_source`: where the attempt that resumed after it restored the state
    from — "peer copy" (a memory snapshot fetched from another host), "local snapshot", "disk" (a
    checkpoint) — read from rank 0's log of that attempt (None: no restart)."""
    path = os.path.join(run_dir, "logs", "worker0.log")
    if not os.path.exists(path):
        return
    with open(path) as f:
        text = f.read()
    starts = list(ATTEMPT.finditer(text))
    logs = {int(m.group(1)): text[m.end():starts[n + 1].start() if n + 1 < len(starts) else len(text)]
            for n, m in enumerate(starts)}
    for row in rows:
        resumed = next((e for e in events if e["kind"] == "resumed" and e["time"] > row["time"]), None)
        log = logs.get(resumed.get("attempt", resumed["restarts"]), "") if resumed and row["kind"] not in ("nan", "redis") else ""
        row["restore_source"] = ("peer copy" if "restored its memory snapshot" in log else
                                 "local snapshot" if "resumed from memory snapshot" in log else
                                 "disk" if "resumed from checkpoint" in log else None)


def per_kind(rows: list[dict]) -> dict:
    table = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue

        def median(key):
            values = [r[key] for r in mine if r.get(key) is not None]
            return statistics.median(values) if values else None

        table[kind] = {"n": len(mine), "detected_s": median("detected_s"), "relaunched_s": median("relaunched_s"),
                       "training_s": median("training_s"), "resumed_s": median("resumed_s"),
                       "steps_lost": median("steps_lost")}
    return table


def job_overrides(steps: int, checkpoint_every: int, snapshot_every: int) -> list[str]:
    return [f"train.steps={steps}", f"checkpoint.every={checkpoint_every}", "checkpoint.keep=3"] + \
        ([f"checkpoint.memory_every={snapshot_every}"] if snapshot_every else [])


def budget(run_dir: str, start: float, wall: float, busy: float, rows: list[dict], step_s: float) -> dict:
    """Where the wall time that was not productive went, in seconds and as a share of the wall:
    start-up (launch to every rank training), checkpoint blocking (every save, rank 0's), memory
    snapshot blocking (rank 0's), recovery
    (each drill's fault to every rank training again: detection, diagnostics, restart, restore,
    compilation; `resumed_s`, to the first step done, where the phases are missing), the same for
    faults no drill caused (`undrilled_faults`),
    redone steps (steps lost x the median step) and the rest (the slow steps of a straggler
    before its eviction, NaN replays, shutdown; negative when the estimates overlap). Recovery is
    split too: before the relaunch (detection, diagnostics, stopping the workers) and after it."""
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    started = next((e for e in events if e["kind"] == "started"), None)
    saves_path = os.path.join(run_dir, "checkpoints.jsonl")
    saves = read_jsonl(saves_path) if os.path.exists(saves_path) else []
    snapshots_path = os.path.join(run_dir, "snapshots.jsonl")
    started_at = every_rank_training_at(started) or (started and started["time"])
    blocking = {"checkpoint_blocking_s": sum(s["block_s"] for s in saves),
                "snapshot_blocking_s": sum(s["block_s"] for s in read_jsonl(snapshots_path))
                if os.path.exists(snapshots_path) else 0.0}
    # Saves in the background block while their step still runs on the devices: that is inside
    # the step's time (training/saving.py), not a loss to subtract again.
    within_steps = saves_block_within_steps(run_dir)
    parts = {"startup_s": started_at - start if started else None,
             **({k: 0.0 for k in blocking} if within_steps else blocking),
             "recovery_s": sum((r["training_s"] if r.get("training_s") is not None else r.get("resumed_s")) or 0.0
                               for r in rows),
             "undrilled_faults_s": sum(f["resumed_s"] or 0.0 for f in undrilled_faults(events)),
             "redone_steps_s": sum(r.get("steps_lost") or 0 for r in rows) * step_s}
    parts["other_s"] = wall - busy - sum(v or 0.0 for v in parts.values())
    return {**parts, "share_of_wall": {k.removesuffix("_s"): None if v is None else v / wall
                                       for k, v in {"productive_s": busy, **parts}.items()},
            "blocking_within_steps_s": sum(blocking.values()) if within_steps else 0.0,
            "recovery_before_relaunch_s": sum(r.get("relaunched_s") or 0.0 for r in rows),
            "checkpoints": len(saves), "checkpoint_block_s_median": statistics.median(s["block_s"] for s in saves)
            if saves else None}


def saves_block_within_steps(run_dir: str) -> bool:
    """Whether the run's saves copy on the device and commit in the background
    (`checkpoint.background_host_copy`): their blocking is then inside the steps' time."""
    path = run_dirs.config_path(run_dir)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return bool((yaml.safe_load(f).get("checkpoint") or {}).get("background_host_copy"))


def run_reference(nprocs: int, job: list[str], work: str) -> dict:
    run_dir = os.path.join(work, "reference")
    start, wall, sampled = launch(run_dir, nprocs, job)
    load = load_record(sampled)
    busy, records = productive(run_dir)
    step_s = statistics.median(r["step_time_s"] for r in records)
    # Faults in a fault-free run are false alarms (a hang or a stall called on a healthy rank):
    # the detector's false-positive count over a run as long as the drilled one.
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    alarms = undrilled_faults(events)
    reference = {"wall_s": wall, "productive_s": busy, "ettr": busy / wall, "final_loss": records[-1]["loss"],
                 "steps": len(records), "step_s_median": step_s, "goodput": len(records) * step_s / wall,
                 "false_alarms": alarms, "budget": budget(run_dir, start, wall, busy, [], step_s),
                 "longest_heartbeat_silence_s": longest_heartbeat_silence(events),
                 "slow_spells": slow_spells(records), "cpu_load": load}
    print(f"reference: ETTR {reference['ettr']:.1%} ({busy:.0f}s of {wall:.0f}s), {len(alarms)} false alarms, "
          f"longest heartbeat silence of a training rank {reference['longest_heartbeat_silence_s']}s", flush=True)
    return reference


def slow_spells(records: list[dict], window: int = 20, slower: float = 1.2) -> list[list]:
    """Runs of steps whose 20-step median is over 1.2x the quiet step (the 10th percentile of
    those medians): [first step, last step, their median step time]. A fault slows a few steps
    after its restart; a spell of hundreds is the machine (`cpu_load` says who had the cores)."""
    times = [r["step_time_s"] for r in records]
    medians = [statistics.median(times[i:i + window]) for i in range(0, len(times) - window + 1, window)]
    if not medians:
        return []
    quiet = sorted(medians)[len(medians) // 10]
    spells, start = [], None
    for n, m in enumerate(medians + [0.0]):
        if m > slower * quiet and start is None:
            start = n
        elif m <= slower * quiet and start is not None:
            first, last = start * window, min(n * window, len(times)) - 1
            spells.append([records[first]["step"], records[last]["step"],
                           round(statistics.median(times[first:last + 1]), 3)])
            start = None
    return spells


def longest_heartbeat_silence(events: list[dict]) -> float | None:
    """The longest gap between two heartbeats of a rank that went on training, any attempt (the
    `done` event): how near a healthy rank came to supervisor.hang_timeout_s. None before the
    supervisor recorded it, or when the run did not finish."""
    done = [e for e in events if e["kind"] == "done"]
    return done[-1].get("longest_heartbeat_silence_s") if done else None


def compare(result: dict, reference: dict) -> dict:
    """Final loss against the fault-free run, and what the faults alone cost: the wall time the
    drilled run lost beyond the reference's own overhead (start-up, compilation, checkpoints), per
    fault, and so the mean time between faults at which this job would keep ETTR >= 95%."""
    final = result["final_loss"]
    lost = (result["wall_s"] - result["productive_s"]) - (reference["wall_s"] - reference["productive_s"])
    per_fault = lost / max(1, result["faults_fired"])
    def mtbf_for(target):  # the mean time between faults at which the faults leave ETTR >= target
        headroom = reference["ettr"] - target  # what the faults may take
        return per_fault / headroom if headroom > 0 else None
    # A run can outlast its fault schedule (drills planned over --minutes, steps slower than
    # planned): ETTR at the schedule's mean interval, for the whole run, from the measured costs.
    # ETTR counts a slowed step as productive; goodput charges every step the fault-free run's
    # median step: what a user gets, in steps, per second of wall (both runs, on the same clock).
    goodput = {"goodput": result["steps"] * reference["step_s_median"] / result["wall_s"]} \
        if "step_s_median" in reference else {}
    return {"reference": reference, "final_loss_equal": final == reference["final_loss"], **goodput,
            "ettr_at_mean_fault_interval": reference["ettr"] - per_fault / mean_fault_interval_s(result),
            "final_loss_rel_diff": abs(final - reference["final_loss"]) / abs(final),
            "fault_cost_s": lost, "fault_cost_per_fault_s": per_fault,
            "mtbf_for_95_s": mtbf_for(0.95), "mtbf_for_97_s": mtbf_for(0.97)}


def reference_for(path: str, borrow: str | None = None) -> None:
    """The fault-free run of a result written with --no-reference, added to that result; with
    `borrow`, another result's fault-free run of the same job (the same overrides, processes and
    steps: seeds change only the fault schedule) instead of running it again."""
    with open(path) as f:
        result = json.load(f)
    if borrow is None:
        job = [c for c in result["config"] if c not in MODEL]  # the drilled run's own overrides, --set included
        reference = run_reference(result["nprocs"], job, tempfile.mkdtemp(prefix="bench-ettr-ref-"))
    else:
        with open(borrow) as f:
            other = json.load(f)
        differs = [k for k in ("config", "nprocs", "steps") if other.get(k) != result.get(k)]
        if differs or not other.get("reference"):
            print(f"error: {borrow} holds no fault-free run of {path}'s job ("
                  + (f"its {', '.join(differs)} differ" if differs else "it has none") + ")", file=sys.stderr)
            raise SystemExit(2)
        lender = other["reference"].get("borrowed_from") or os.path.relpath(borrow)  # the run's own file
        reference = {**other["reference"], "borrowed_from": lender}
    result.update(compare(result, reference))
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(summary_of_comparison(result) + f"; updated {path}")


def recount(path: str) -> None:
    """The per-fault rows and the budget of a result again, from its run directory (its
    `work_dir`), with this file's accounting; the rest of the result is kept."""
    with open(path) as f:
        result = json.load(f)
    run_dir = os.path.join(result["work_dir"], "drilled")
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    busy, records = productive(run_dir)
    rows = consequences(events)
    add_restore_sources(run_dir, events, rows)
    started = next(e for e in events if e["kind"] == "started")
    # the launch's start, as the run measured it (results before launched_at: from their start-up,
    # which then ended at the `started` event)
    start = result.get("launched_at") or started["time"] - result["budget"]["startup_s"]
    if result.get("reference"):
        result.update(compare(result, result["reference"]))
    result.update(launched_at=start, faults=rows, per_kind=per_kind(rows), undrilled_faults=undrilled_faults(events),
                  steps_lost=sum(r["steps_lost"] or 0 for r in rows), startup_phases_s=startup_phases(run_dir),
                  slow_spells=slow_spells(records),
                  budget=budget(run_dir, start, result["wall_s"], busy, rows, result["step_s_median"]))
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"recounted {path}: " + ", ".join(f"{k} {v:.1%}" for k, v in result["budget"]["share_of_wall"].items()
                                             if v is not None))


def summary_of_comparison(result: dict) -> str:
    def at(target):
        mtbf = result.get(f"mtbf_for_{target}_s")
        return f"ETTR >= {target}% at " + (f"a fault every >= {mtbf / 60:.1f} min" if mtbf else
                                          f"no fault rate (the reference is below {target}%)")
    return (f"final loss {result['final_loss']:.6f} vs {result['reference']['final_loss']:.6f} fault-free "
            f"(equal: {result['final_loss_equal']}, relative difference {result['final_loss_rel_diff']:.2e}); "
            f"faults cost {result['fault_cost_per_fault_s']:.1f}s of wall each; {at(95)}; {at(97)}; "
            f"ETTR {result['ettr_at_mean_fault_interval']:.1%} with a fault every {mean_fault_interval_s(result) / 60:.1f} min "
            "from start to end" + (f"; goodput {result['goodput']:.1%} vs {result['reference']['goodput']:.1%} fault-free "
                                   "(steps x the fault-free median step / wall)" if "goodput" in result else ""))


def main(argv=None) -> int:
    bench = Bench(__doc__, "ettr_cpu")
    bench.add_argument("--minutes", type=float, default=30.0, help="length of the drilled run (about)")
    bench.add_argument("--nprocs", type=int, default=4)
    bench.add_argument("--spares", type=int, default=2)
    bench.add_argument("--fault-every", type=float, nargs=2, default=(120.0, 300.0), metavar=("MIN_S", "MAX_S"))
    bench.add_argument("--checkpoint-s", type=float, default=30.0, help="seconds of training between checkpoints")
    bench.add_argument("--snapshot-s", type=float, default=0.0,
                       help="seconds of training between memory snapshots (0 = none)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--step-s", type=float, metavar="SECONDS",
                       help="the step time to plan with, instead of calibrating (a short launch on a busy "
                            "machine can misjudge it by 2x: the 20-min run measured 2.5 s for a 1.5 s step)")
    bench.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="a config override for every run of the job (repeatable), e.g. checkpoint.background_host_copy=true")
    bench.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    bench.add_argument("--reference-for", metavar="RESULT_JSON",
                       help="only run the fault-free run of a --no-reference result and add it there")
    bench.add_argument("--reference-from", metavar="OTHER_RESULT_JSON",
                       help="with --reference-for: take the fault-free run of another result of the same job "
                            "(another seed) instead of running it")
    bench.add_argument("--recount", metavar="RESULT_JSON",
                       help="only recompute a result's per-fault rows and budget from its run directory")
    args = bench.parse_args(argv)
    if args.reference_from and not args.reference_for:
        bench.parser.error("--reference-from goes with --reference-for RESULT_JSON")
    if args.reference_for:
        reference_for(args.reference_for, args.reference_from)
        return 0
    if args.recount:
        recount(args.recount)
        return 0
    bench.refuse_existing()
    work = tempfile.mkdtemp(prefix="bench-ettr-")
    print(f"work directory: {work}", flush=True)

    # 1. calibrate
    step_s = args.step_s
    if step_s is None:
        launch(os.path.join(work, "calibrate"), args.nprocs, ["train.steps=30", "checkpoint.every=0"])
        step_s = statistics.median(r["step_time_s"] for r in productive(os.path.join(work, "calibrate"))[1][5:])
    steps = max(20, int(args.minutes * 60 * 0.95 / step_s))  # ~5% of the wall goes to faults and start-up
    every = max(1, int(args.checkpoint_s / step_s))
    snapshot_every = max(1, int(args.snapshot_s / step_s)) if args.snapshot_s else 0
    job = job_overrides(steps, every, snapshot_every) + args.set
    print(f"step {step_s:.3f}s -> {steps} steps, a checkpoint every {every} steps ({every * step_s:.0f}s)"
          + (f", a memory snapshot every {snapshot_every}" if snapshot_every else ""), flush=True)

    # 2. fault-free reference
    reference = None if args.no_reference else run_reference(args.nprocs, job, work)

    # 3. drilled
    rng = random.Random(args.seed)
    drills, t, kinds = [], 0.0, []
    while True:
        t += rng.uniform(*args.fault_every)
        # Planned past --minutes: a run slower than planned (restarts, slower steps) meets faults at
        # the same rate until it ends (the drills after its end never fire). Until 2026-11-25 the
        # schedule stopped at --minutes: the 36.7-min run had no fault in its last 8.7 min.
        if t > args.minutes * 60 * 1.5:
            break
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        drills.append(f"{kind}@t{t:.0f}" if kind in RANKLESS else f"{kind}:{rng.randrange(args.nprocs)}@t{t:.0f}")
    run_dir = os.path.join(work, "drilled")
    start, wall, sampled = launch(run_dir, args.nprocs, job, drills, args.spares)
    load = load_record(sampled)
    busy, records = productive(run_dir)
    step_s_median = statistics.median(r["step_time_s"] for r in records)
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    rows = consequences(events)
    add_restore_sources(run_dir, events, rows)
    shrunk = any(e["kind"] == "shrink" for e in events)
    final = records[-1]["loss"]
    result = {
        "minutes": args.minutes, "nprocs": args.nprocs, "spares": args.spares, "fault_every_s": list(args.fault_every),
        "seed": args.seed, "steps": steps, "step_s_planned": step_s,
        "step_s_planned_from": "calibration" if args.step_s is None else "--step-s",
        "step_s_median": step_s_median, "checkpoint_every_steps": every,
        "snapshot_every_steps": snapshot_every,
        "config": MODEL + job, "drills": drills,
        "wall_s": wall, "productive_s": busy, "ettr": busy / wall,
        # Stricter: every step charged at the median step, so the steps a straggler, a NaN replay or
        # the standby processes' imports slowed count as loss too.
        "ettr_at_median_step": len(records) * step_s_median / wall, "faults_fired": len(rows),
        "restarts": sum(e["kind"] == "restart" for e in events), "shrinks": sum(e["kind"] == "shrink" for e in events),
        "steps_lost": sum(r["steps_lost"] or 0 for r in rows), "per_kind": per_kind(rows), "faults": rows,
        "undrilled_faults": undrilled_faults(events), "startup_phases_s": startup_phases(run_dir),
        "longest_heartbeat_silence_s": longest_heartbeat_silence(events),
        "budget": budget(run_dir, start, wall, busy, rows, step_s_median),
        "final_loss": final, "reference": None, "final_loss_equal": None, "final_loss_rel_diff": None,
        "fault_cost_s": None, "fault_cost_per_fault_s": None, "mtbf_for_95_s": None, "mtbf_for_97_s": None,
        "shrunk": shrunk, "cpu_cores": os.cpu_count(), "work_dir": work, "launched_at": start,
        "slow_spells": slow_spells(records), "cpu_load": load,
    }
    if reference is not None:
        result.update(compare(result, reference))
    print(f"drilled: ETTR {result['ettr']:.1%} ({busy:.0f}s of {wall:.0f}s; "
          f"{result['ettr_at_median_step']:.1%} at the median step), {len(rows)} faults, "
          f"{result['restarts']} restarts, {result['steps_lost']} steps lost; final loss {final:.6f}"
          + ("" if reference is None else f"\n{summary_of_comparison(result)}"), flush=True)
    print("  where the wall went: " + ", ".join(f"{k} {v:.1%}" for k, v in result["budget"]["share_of_wall"].items()
                                                if v is not None), flush=True)
    for kind, row in result["per_kind"].items():
        print(f"  {kind:8s} n={row['n']} detected {row['detected_s']} s, relaunched {row['relaunched_s']} s, "
              f"training {row['training_s']} s, resumed {row['resumed_s']} s, "
              f"lost {row['steps_lost']} steps")
    print(f"  slow spells (first step, last step, median step s): {result['slow_spells']}; CPU meanwhile: "
          f"job {load['job_core_s']} core-s, others {load['foreign_core_s']}, steal {load['steal_core_s']}, "
          f"others above a quarter core for >= 10 s at {load['foreign_spells_s']} s", flush=True)
    print("  restored from: " + ", ".join(f"{r['kind']} {r.get('restore_source')}" for r in rows), flush=True)
    for r in rows:  # what each drill was judged to be, and why a slot was excluded for it
        print(f"  {r['kind']}:{r['rank']} judged {' then '.join(r['verdicts']) or 'nothing'}"
              + "".join(f"; excluded rank {e['rank']} ({e['host']}): {e['reason']}" for e in r["evictions"]), flush=True)
    bench.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
