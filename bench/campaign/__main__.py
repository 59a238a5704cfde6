"""The GPU campaign: every measurement this project wants from a lent GPU, in one command.

    python -m bench.campaign                          # all sections; ~25 min on one H200
    python -m bench.campaign --only kernels,checkpoints --overwrite   # rerun sections
    python -m bench.campaign --dry-run                # every section, tiny, on the CPU
    python -m bench.campaign --tiny                   # every section, tiny, on the GPU (smoke test)
    python -m bench.campaign --only mfu_ladder --budget-s 540   # stop starting work after 540 s

Run from the checkout's root (or with it on PYTHONPATH). Sections, each in its own module of
bench/campaign/:
  kernels         attention fwd+bwd per (seq, window) and contender, Pallas tiles tuned per
                  shape; LayerNorm+residual and bias+GeLU, Pallas vs XLA             (kernels)
  mfu_ladder      MFU, tokens/s and peak memory as MegaScale's techniques are added one by one
                  to a 1.4B model on one device                                       (ladder)
  levers          each one-GPU lever alone on one base configuration (sliced loss, unrolled
                  layers, fused norms, remat, batch, XLA flags), its change in tokens/s (levers)
  torch_peer      the ladder's first three rows in PyTorch on the same token rows: Llama,
                  GPT-NeoX, GPT-NeoX with FlexAttention's sliding window      (torch_peer)
  checkpoints     blocking vs total save, and restore, for 1/4/16 GB, with the host copy in
                  save() and on a thread (background_host_copy)                  (checkpoints)
  profiled_steps  observe.profile_every on the device, report's device heat map; where a step's
                  device time goes by model part, at the batch and at half of it   (profile)
  rates           GEMM device time by shape and the streaming HBM rate, for the planner's
                  calibration (megascale_jax.planner.measured.gemm_fit)              (rates)

The result is bench/results/gpu_<device>_<date>.json (or --out PATH) with PNGs beside it and,
at its top, `summary`: the numbers issue 36's claims are checked against (`claims.KEYS`: best MFU,
tokens/s and batch, the same-work and dense ratios to the PyTorch peer, both peaks, the worst
attention ratio to cuDNN, the 16 GB background save's blocking share, the device-to-host rate),
None where nothing measured them. It records (PNGs with the same name stem) the device, NVIDIA
driver (null without nvidia-smi), jax, jaxlib, torch and other versions, the exact command, and
per section its status ("ok", "skipped" or "error" with one line saying why), its wall time and
its numbers. An existing result is never replaced
without --overwrite; with --only, the sections run replace theirs in an existing result and
the others are kept (each section records the command that produced it). The file is written
after every section, so a campaign stopped from outside (a lease's time limit) keeps what it
finished. A lent GPU is held for a fixed time per call (the device tool: 600 s): --budget-s
makes the campaign fit it. A section starts only with at least MIN_SECTION_S of the budget left
(otherwise it is recorded as skipped, with why) and runs under what is left; inside the MFU ladder
and the levers, a row starts only while its section has MIN_ROW_S left (otherwise it is a
"skipped: not started" row). Rows are also appended to a progress file as they finish, so a
section that is killed anyway (its time limit) keeps its finished rows, as `rows_done`.

Isolation: this process never starts a JAX backend (that would reserve most of the GPU's
memory); it probes the device, then runs each section as `python -m bench.campaign.worker` in
a process of its own with a time limit (`process`), so an abort, a hang or an
out-of-memory death costs that section only. The exit status is 1 when a section failed, after
everything is written; 2 for a bad command line, before anything runs.

--dry-run runs every section at tiny shapes on the CPU (JAX's CPU backend, Pallas in interpret
mode; GPU-only contenders are one line, "skipped: needs a GPU"), writing into a new temporary
directory, or --out, never into bench/results/ (it measures nothing worth keeping). It proves
plumbing: in the ladder and the levers, a row whose code the unit tests train is validated
(config checked, estimate traced: `ladder.validated`) and recorded as skipped, not trained. --tiny runs
the same tiny shapes on this machine's own backend: a minute-long smoke test of every GPU code
path before a full campaign spends its time (written like a dry run, never into bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time

from bench.campaign import claims, device, plots, process, summary
from bench.common import RESULTS, command_line, invocation, result_path

SECTIONS = ("kernels", "mfu_ladder", "levers", "torch_peer", "checkpoints", "profiled_steps", "rates")
# Time limits: safety nets against hangs, well above what each section needs on an H100
# (on an H200, 2026-11-23: kernels 246 s, ladder 194 s without its first row and the later remat row,
# torch 163 s, checkpoints 81 s before it measured background_host_copy too, profiled 23 s).
LIMIT_S = {"probe": 300, "kernels": 900, "mfu_ladder": 1800, "levers": 1200, "torch_peer": 600, "checkpoints": 900,
           "profiled_steps": 600, "rates": 300}
# Modules the sections import that a lent GPU machine lacks (it has jax, flax, optax, orbax, chex,
# torch, transformers and triton): gpu_wheels.sh fetches their wheels. jax_triton and tokamax are
# contenders in the kernels section only, which records them as skipped rows when they are missing.
NEEDED_WHEELS = ("grain", "tensorboardX", "redis")
MIN_SECTION_S = 30  # a section is not started with less of --budget-s left than this
SAVE_MARGIN_S = 10  # kept back from --budget-s for the final plots and save
# In a dry run nothing is measured, so XLA:CPU may skip LLVM's optimisations: compiling the
# tiny models' steps takes about half as long.
DRY_RUN_XLA_FLAGS = "--xla_backend_optimization_level=0"


def section_list(values: list[str]) -> list[str]:
    """`--only a --only b,c` -> [a, b, c] in campaign order; unknown names raise ValueError."""
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    unknown = sorted(names - set(SECTIONS))
    if unknown or not names:
        raise ValueError(f"unknown section {unknown[0] if unknown else ''!r}; sections are {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=invocation(), description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="SECTION",
                        help=f"run only these sections (repeatable or comma list): {', '.join(SECTIONS)}")
    parser.add_argument("--dry-run", action="store_true",
                        help="every section at tiny shapes on the CPU, written to a temporary directory")
    parser.add_argument("--tiny", action="store_true",
                        help="every section at the dry run's tiny shapes on this machine's backend (a GPU smoke test)")
    parser.add_argument("--batch", type=int, default=None, metavar="N",
                        help="sequences per microbatch in the training sections (default: the largest the estimate fits)")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="start no section (and no ladder or lever row) that cannot finish within S seconds "
                             "of the campaign's start (a lent GPU's per-call time limit)")
    parser.add_argument("--out", default=None, help="result file (default bench/results/gpu_<device>_<date>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace (or, with --only, update) an existing result")
    parser.add_argument("--fail-section", action="append", default=[], help=argparse.SUPPRESS)  # tests only
    return parser.parse_args(argv)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)


def run_piece(name: str, settings: dict, scratch: str, limit_s: float | None = None) -> dict:
    """Run section (or probe) `name` in its own process for at most `limit_s` (default LIMIT_S);
    its record: status, seconds, numbers. The section may start work until `settings["deadline"]`
    (epoch seconds), a little before its limit, and appends each finished row to
    `settings["progress_file"]`: a section that fails or is killed keeps those rows (`rows_done`)."""
    limit_s = LIMIT_S[name] if limit_s is None else limit_s
    progress = os.path.join(scratch, f"{name}.rows.jsonl")
    settings = {**settings, "deadline": time.time() + limit_s - SAVE_MARGIN_S, "progress_file": progress}
    settings_path = os.path.join(scratch, f"{name}.settings.json")
    result_file = os.path.join(scratch, f"{name}.result.json")
    with open(settings_path, "w") as f:
        json.dump(settings, f)
    print(f"== {name} (limit {limit_s:.0f} s)", flush=True)
    start = time.perf_counter()
    done = process.run(process.python("bench.campaign.worker", name, settings_path, result_file),
                       env=dict(os.environ), limit_s=limit_s, prefix=f"[{name}]")
    record = {"seconds": round(time.perf_counter() - start, 1), "command": command_line(),
              "finished": datetime.datetime.now().isoformat(timespec="seconds")}
    if not done.ok:
        rows = rows_done(progress)
        return {"status": "error", "reason": done.failure(limit_s), **record, **({"rows_done": rows} if rows else {})}
    with open(result_file) as f:
        result = json.load(f)
    if "skipped" in result:
        return {"status": "skipped", "reason": result["skipped"], **record}
    return {"status": "ok", **record, **result}


def rows_done(progress_file: str) -> list[dict]:
    """The rows a section appended to its progress file before it ended (a last line cut off by
    a kill is left out)."""
    if not os.path.exists(progress_file):
        return []
    rows = []
    with open(progress_file) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def missing_wheels() -> list[str]:
    """The modules of NEEDED_WHEELS this Python cannot import (looked up, not imported)."""
    import importlib.util

    return [m for m in NEEDED_WHEELS if importlib.util.find_spec(m) is None]


def section_limit(name: str, deadline: float | None) -> tuple[float | None, str]:
    """(time limit, '') for section `name` under the campaign's deadline, or (None, why) when too
    little of --budget-s is left to start it."""
    if deadline is None:
        return LIMIT_S[name], ""
    left = deadline - time.time() - SAVE_MARGIN_S
    if left < MIN_SECTION_S:
        return None, f"not started: {max(left, 0):.0f} s of --budget-s left (a section needs {MIN_SECTION_S})"
    return min(LIMIT_S[name], left), ""


def save(path: str, result: dict) -> None:
    """Write the campaign's result (replacing this run's own earlier write of it). The provenance
    comes from the probe and the installed versions: this process never starts a JAX backend."""
    with open(path + ".partial", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".partial", path)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        only = section_list(args.only) if args.only else list(SECTIONS)
        fail = section_list(args.fail_section) if args.fail_section else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:  # for this process's own provenance too, and inherited by every section
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DRY_RUN_XLA_FLAGS]).strip()
    tiny = args.dry_run or args.tiny
    if tiny and args.out and inside(args.out, RESULTS):
        flag = "--dry-run" if args.dry_run else "--tiny"
        print(f"error: {flag} measures nothing worth keeping; pass an --out outside {os.path.relpath(RESULTS)}/",
              file=sys.stderr)
        return 2

    if args.batch is not None and args.batch < 1:
        print(f"error: --batch must be at least 1, got {args.batch}", file=sys.stderr)
        return 2
    if args.budget_s is not None and args.budget_s <= 0:
        print(f"error: --budget-s must be positive, got {args.budget_s:g}", file=sys.stderr)
        return 2
    missing = missing_wheels()
    if missing:
        print(f"error: {', '.join(missing)} not installed here: run `bash bench/campaign/gpu_wheels.sh` on a machine "
              "with network and install its wheels here (docs/gpu.md, 'On a lent GPU')", file=sys.stderr)
        return 2
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    scratch = tempfile.mkdtemp(prefix="gpu-campaign-")  # settings and results passed to and from sections
    # torch (the PyTorch peer) keeps its compile cache in $TMPDIR/torchinductor_<user> unless told
    # otherwise; the sections inherit this, so the campaign leaves nothing behind.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(scratch, "torchinductor"))
    try:
        return campaign(args, only, fail, scratch, deadline)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def campaign(args, only: list[str], fail: list[str], scratch: str, deadline: float | None = None) -> int:
    tiny = args.dry_run or args.tiny
    probe = run_piece("probe", {"dry_run": tiny}, scratch)
    if probe["status"] != "ok":
        print(f"error: could not start JAX on this machine: {probe['reason']}", file=sys.stderr)
        return 1
    found = {k: probe[k] for k in ("device_kind", "backend", "device_count", "memory_limit_bytes")}
    if found["backend"] != "gpu" and not tiny:
        print(f"error: {invocation()} needs a GPU (JAX backend is {found['backend']!r}); run it on a GPU "
              "machine, or pass --dry-run to exercise every section at tiny shapes on the CPU", file=sys.stderr)
        return 2

    date = datetime.date.today().isoformat()
    name = f"gpu_{slug(found['device_kind'])}_{date}"
    if args.out:
        path = args.out
    else:
        folder = tempfile.mkdtemp(prefix="gpu-campaign-dry-run-") if tiny else RESULTS
        path = os.path.join(folder, f"{name}.json")
    path = result_path(name, path, args.overwrite)
    sections = {}
    if args.only and os.path.exists(path):  # --only updates an existing result (--overwrite given)
        with open(path) as f:
            existing = json.load(f)
        if existing.get("device") != found["device_kind"]:
            print(f"error: {os.path.relpath(path)} holds results of {existing.get('device')!r}, not of this "
                  f"{found['device_kind']!r}; pass another --out", file=sys.stderr)
            return 2
        sections = existing.get("sections", {})
    png_stem = os.path.splitext(path)[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    settings = {"dry_run": tiny, "device": found, "png_stem": png_stem, "fail_sections": fail, "batch": args.batch}
    header = {"command": command_line(), "device": found["device_kind"], "devices": found["device_count"],
              "backend": found["backend"], **device.versions(), "dry_run": args.dry_run,
              "tiny": args.tiny, "date": date, **device.host_facts(),
              "memory_limit_bytes": found["memory_limit_bytes"],
              "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}
    failed, not_started = [], []
    for section in only:
        limit, why = section_limit(section, deadline)
        if limit is None:
            sections[section] = {"status": "skipped", "reason": why, "seconds": 0.0, "command": command_line()}
            not_started.append(section)
        else:
            sections[section] = run_piece(section, settings, scratch, limit)
        if sections[section]["status"] == "error":
            failed.append(section)
            print(f"[{section}] error: {sections[section]['reason']}", flush=True)
        sections = {s: sections[s] for s in SECTIONS if s in sections}
        save(path, {**header, "sections": sections})  # what is done survives a stop from outside
    pngs, problems = plots.draw(sections, png_stem)
    # with --only, the claims are read off the sections kept from before as well
    claimed = claims.summary(found["device_kind"], sections)
    save(path, {**header, "summary": claimed, "sections": sections, "pngs": pngs, "png_problems": problems})
    print()
    summary.show(sections, pngs, problems)
    summary.claims(claimed)
    print(f"\nwrote {path}" + (f"; sections that failed: {', '.join(failed)}" if failed else "")
          + (f"; not started (--budget-s): {', '.join(not_started)}" if not_started else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
