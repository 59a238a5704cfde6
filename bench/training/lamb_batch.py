"""LAMB at 4x the batch against AdamW at the batch, on the same tokens: does LAMB keep the loss?

    python -m bench.training.lamb_batch [--batch 8] [--large-steps 120] [--seeds 3] [key=value ...]

MegaScale adopts LAMB because it "scales the batch 4x without accuracy loss" (a 4x batch means 4x
the microbatches per step, so a pipeline's bubble shrinks). This study trains the default model
(configs/tiny_cpu.yaml; `key=value` overrides change it) on the Python standard library's sources
(the trainer's `data.source=stdlib`, byte-level) in three arms that all see the same number of
tokens:

* `adamw_B`   AdamW at `--batch` B sequences per step, for 4 x `--large-steps` steps;
* `lamb_4B`   LAMB at 4B sequences (`--microbatches` per step), for `--large-steps` steps;
* `adamw_4B`  AdamW at 4B, the control: plain Adam at the large batch is expected to lose.

Each arm's peak learning rate is its own best (lowest final validation loss at seed 0) from a
small sweep (`--adamw-lrs`, `--lamb-lrs`, `--adamw-4b-lrs`); the winner is then run at the other
seeds (`--seeds` in all; the seed sets the initialisation and the data order). The schedule is
the trainer's: linear warmup over `--warmup` of each arm's steps, then cosine decay. Validation
loss is measured on the same held-out sequences at `--evals` points along the way.

The claim holds if LAMB@4B's mean final validation loss is no worse than AdamW@B's by more than
the seed noise: 2 x the standard error of the difference of the two means,
sqrt(s_a^2/n + s_b^2/n), with s the seeds' standard deviation (`compare`).

Training runs in this process through the project's own trainer (`training.trainer.build_trainer`:
the model, `training/optim.py`'s LAMB and AdamW, the jitted train and eval steps) on a
`--dp` x 1 x 1 mesh — one device by default: the same numbers as any mesh (the parity tests),
and no collectives, which on a busy shared CPU can starve (XLA:CPU aborts a simulated device's
collective that waits 40 s for its peers; it did, once, at dp=2).
JSON and a PNG of the validation curves go to bench/results/lamb_batch_<platform>.{json,png}.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import tempfile
import time

import numpy as np

from bench.common import Bench

LARGE = 4  # the large arms' batch is LARGE x --batch (MegaScale's "4x")


def arms(args) -> list[dict]:
    """The study's three arms: optimizer, batch, steps, microbatches and the learning rates swept."""
    large_batch = LARGE * args.batch
    return [
        {"arm": "adamw_B", "optimizer": "adamw", "batch": args.batch, "steps": LARGE * args.large_steps,
         "microbatches": 1, "lrs": args.adamw_lrs},
        {"arm": "lamb_4B", "optimizer": "lamb", "batch": large_batch, "steps": args.large_steps,
         "microbatches": args.microbatches, "lrs": args.lamb_lrs},
        {"arm": "adamw_4B", "optimizer": "adamw", "batch": large_batch, "steps": args.large_steps,
         "microbatches": args.microbatches, "lrs": args.adamw_4b_lrs},
    ]


def input_error(args) -> str | None:
    """What is wrong with the study's command line, as one line naming the fix (None: nothing).
    Checked before anything is loaded or compiled."""
    for flag, lrs in (("--adamw-lrs", args.adamw_lrs), ("--lamb-lrs", args.lamb_lrs),
                      ("--adamw-4b-lrs", args.adamw_4b_lrs)):
        bad = [lr for lr in lrs if not lr > 0]  # also NaN
        if bad:
            return f"{flag} {bad[0]}: every learning rate in a sweep must be > 0; drop or raise it"
    if args.batch < 1 or args.dp < 1 or args.microbatches < 1:
        return "--batch, --dp and --microbatches must be >= 1"
    # Each microbatch is split over dp, so every arm's batch must divide by dp x its microbatches.
    # The fix names the batches that work: multiples of dp (the B arm, one microbatch) whose 4x
    # divides by dp x microbatches (the 4B arms).
    per_step = args.dp * args.microbatches
    need = math.lcm(args.dp, per_step // math.gcd(LARGE, per_step))
    if (LARGE * args.batch) % per_step:
        return (f"--batch {args.batch}: the 4x arms' batch {LARGE * args.batch} does not divide by --dp {args.dp} x "
                f"--microbatches {args.microbatches} = {per_step}; pass a --batch that is a "
                f"multiple of {need}, or change --dp/--microbatches")
    if args.batch % args.dp:
        return (f"--batch {args.batch} does not divide by --dp {args.dp} (the AdamW@B arm splits it over dp); "
                f"pass a --batch that is a multiple of {need}")
    if args.seeds < 2:
        return f"--seeds {args.seeds}: the seed spread needs at least 2 seeds (3 by default)"
    if args.large_steps < 1 or args.evals < 1 or args.large_steps % args.evals:
        return (f"--large-steps {args.large_steps} must be a positive multiple of --evals {args.evals} "
                "(every arm is evaluated at the same token counts)")
    if not 0 <= args.warmup < 1:
        return f"--warmup {args.warmup}: the share of each arm's steps spent warming up must be in [0, 1)"
    return None


def arm_config(args, arm: dict, lr: float, seed: int):
    """The trainer's Config for one run of `arm`: the default config, the user's overrides, then
    the study's own keys (mesh, optimizer, batch, steps, seed) on top."""
    from megascale_jax.config import load_config

    return load_config(None, [
        *args.overrides, f"mesh.dp={args.dp}", "mesh.pp=1", "mesh.tp=1",
        f"optim.name={arm['optimizer']}", f"optim.lr={lr}", f"optim.warmup={round(args.warmup * arm['steps'])}",
        f"train.global_batch={arm['batch']}", f"train.steps={arm['steps']}", f"train.seed={seed}",
        f"parallel.microbatches={arm['microbatches']}"])


def train_run(cfg, tokens: np.ndarray, val_sequences: int, evals: int) -> dict:
    """Train `cfg` from scratch with the project's trainer; the validation loss at `evals` evenly
    spaced points (and at the start) against the tokens seen. A run whose loss turns non-finite
    stops there: the train step then holds its state (training/trainer.py), marked by a negative
    step, and the run is recorded as diverged."""
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training import data
    from megascale_jax.training.trainer import build_trainer

    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    train = data.SequenceBatches.from_config(cfg, tokens, "train")
    # The first `val_sequences` held-out sequences, the same for every arm and seed.
    val = data.make_global_batch(
        data.SequenceBatches(tokens, cfg.model.seq_len, "val", cfg.data.val_fraction, 0, val_sequences),
        0, trainer.batch_sharding)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    every = cfg.train.steps // evals
    start = time.perf_counter()
    state = trainer.init()
    curve = [[0, float(trainer.eval_loss(state.params, val))]]
    diverged = False
    for step in range(1, cfg.train.steps + 1):
        state, _ = trainer.train_step(state, data.make_global_batch(train, step - 1, trainer.batch_sharding))
        if step % every == 0:
            if int(state.step) < 0:  # held: a step was non-finite
                diverged = True
                break
            curve.append([step * tokens_per_step, float(trainer.eval_loss(state.params, val))])
    final = curve[-1][1] if not diverged and math.isfinite(curve[-1][1]) else None
    return {"curve": curve, "final_val_loss": final, "diverged": final is None,
            "wall_s": round(time.perf_counter() - start, 2)}


def spread(values: list[float]) -> dict:
    """Mean, standard deviation (ddof=1) and range of one arm's final losses over seeds."""
    v = np.asarray(values, dtype=float)
    return {"seeds": [float(x) for x in v], "mean": float(v.mean()), "std": float(v.std(ddof=1)),
            "min": float(v.min()), "max": float(v.max())}


def compare(candidate: list[float], reference: list[float]) -> dict:
    """`candidate`'s final losses (over seeds) against `reference`'s: the difference of the means
    (positive: the candidate is worse), the seed noise (2 x the standard error of that difference)
    and whether the candidate is no worse than the reference beyond that noise."""
    a, b = np.asarray(candidate, dtype=float), np.asarray(reference, dtype=float)
    difference = float(a.mean() - b.mean())
    noise = float(2 * np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
    return {"difference": difference, "noise": noise, "not_worse": difference <= noise,
            "worse": difference > noise}


def choose_lr(sweep: list[dict]) -> tuple[float, bool]:
    """The learning rate with the lowest final validation loss among the runs that did not
    diverge, and whether it lies at an end of the sweep (then a wider sweep may do better)."""
    finished = [r for r in sweep if r["final_val_loss"] is not None]
    if not finished:
        raise RuntimeError(f"every learning rate diverged: {[r['lr'] for r in sweep]}; sweep lower ones")
    best = min(finished, key=lambda r: r["final_val_loss"])["lr"]
    lrs = sorted(r["lr"] for r in sweep)
    return best, len(lrs) > 1 and best in (lrs[0], lrs[-1])


def plot(path: str, runs: list[dict], chosen: dict, summary: dict, claim: dict, control: dict) -> None:
    """Validation loss against tokens, one line per arm (the seeds' mean at its chosen learning
    rate) with the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, color in zip(chosen, ("tab:blue", "tab:green", "tab:red")):
        curves = [r["curve"] for r in runs if r["arm"] == arm and r["lr"] == chosen[arm] and not r["diverged"]]
        tokens = np.array([t for t, _ in curves[0]][1:]) / 1e6  # from the first evaluation: 0 tokens is ~5.5
        losses = np.array([[loss for _, loss in c][1:] for c in curves])
        s = summary[arm]
        ax.plot(tokens, losses.mean(axis=0), color=color,
                label=f"{arm} lr {chosen[arm]:g}: {s['mean']:.3f} ± {s['std']:.3f}")
        ax.fill_between(tokens, losses.min(axis=0), losses.max(axis=0), color=color, alpha=0.25)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"LAMB@4B − AdamW@B = {claim['difference']:+.3f} (noise ±{claim['noise']:.3f}); "
                 f"AdamW@4B − AdamW@B = {control['difference']:+.3f}", fontsize=9)
    ax.legend(title="final val loss, mean ± std over seeds (shaded: range)", fontsize=8, title_fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    bench = Bench(__doc__, "lamb_batch_<platform>")
    bench.add_argument("--batch", type=int, default=8, help="B: sequences per step of the AdamW@B arm (default 8)")
    bench.add_argument("--large-steps", type=int, default=120,
                       help="steps of the 4B arms; the B arm runs 4x as many, so every arm sees the same tokens")
    bench.add_argument("--seeds", type=int, default=3, help="seeds per arm at its chosen learning rate (default 3)")
    bench.add_argument("--evals", type=int, default=10, help="validation points along each run (default 10)")
    bench.add_argument("--val-sequences", type=int, default=128, help="held-out sequences evaluated (default 128)")
    bench.add_argument("--warmup", type=float, default=0.05, help="share of each arm's steps warming up (default 0.05)")
    bench.add_argument("--dp", type=int, default=1, help="data-parallel (simulated CPU) devices (default 1: no collectives)")
    bench.add_argument("--microbatches", type=int, default=1, help="microbatches per step of the 4B arms (default 1)")
    # The sweeps: factors of 2 around each optimizer's usual rate for a model this size. LAMB's
    # rate is relative (an update is lr x the layer's weight norm), hence 10x AdamW's.
    bench.add_argument("--adamw-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3],
                       help="peak learning rates swept for AdamW@B (default 2e-3 4e-3 8e-3)")
    bench.add_argument("--lamb-lrs", type=float, nargs="+", default=[2e-2, 4e-2, 8e-2],
                       help="peak learning rates swept for LAMB@4B (default 2e-2 4e-2 8e-2)")
    bench.add_argument("--adamw-4b-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3],
                       help="peak learning rates swept for AdamW@4B (default 2e-3 4e-3 8e-3)")
    bench.add_argument("overrides", nargs="*", help="config overrides for the model, e.g. model.layers=2")
    args = bench.parse_args(argv, intermixed=True)

    from megascale_jax import cli
    from megascale_jax.config import ConfigError

    problem = input_error(args)
    if problem is None:
        try:  # every run's config, checked now: a bad override is one line before anything runs
            for arm in arms(args):
                arm_config(args, arm, arm["lrs"][0], 0)
        except ConfigError as e:
            problem = str(e)
    if problem:
        return cli.user_error(problem)

    import jax

    from megascale_jax.parallel.mesh import use_cpu_devices

    try:
        use_cpu_devices(args.dp)  # simulated devices if on CPU; before JAX starts
    except RuntimeError:
        pass  # JAX already started in this process (a test): the mesh takes the first dp devices
    path = bench.refuse_existing(f"lamb_batch_{jax.default_backend()}")

    from megascale_jax.training import compile_cache, data

    start, load_before = time.perf_counter(), os.getloadavg()[1]
    tokens = data.load_corpus(arm_config(args, arms(args)[0], 1.0, 0)).tokens
    runs, chosen, at_edge = [], {}, {}

    def run(arm: dict, lr: float, seed: int) -> dict:
        cfg = arm_config(args, arm, lr, seed)
        result = {"arm": arm["arm"], "optimizer": arm["optimizer"], "batch": arm["batch"], "steps": arm["steps"],
                  "lr": lr, "seed": seed, **train_run(cfg, tokens, args.val_sequences, args.evals)}
        loss = "diverged" if result["diverged"] else f"{result['final_val_loss']:.4f}"
        print(f"{arm['arm']:<9} lr {lr:<8g} seed {seed}  final val loss {loss}  ({result['wall_s']:.0f} s)", flush=True)
        runs.append(result)
        return result

    # JAX's persistent cache for the study's own runs: a seed changes the initialisation and the
    # data, not the train step's program, so the other seeds load the winner's compiled step.
    with tempfile.TemporaryDirectory(prefix="lamb_batch-") as scratch, compile_cache.use(scratch):
        for arm in arms(args):  # the sweep at seed 0, then the other seeds at the winner
            sweep = [run(arm, lr, 0) for lr in arm["lrs"]]
            chosen[arm["arm"]], at_edge[arm["arm"]] = choose_lr(sweep)
            for seed in range(1, args.seeds):
                run(arm, chosen[arm["arm"]], seed)

    finals = {a: [r["final_val_loss"] for r in runs if r["arm"] == a and r["lr"] == chosen[a]] for a in chosen}
    if any(v is None for values in finals.values() for v in values):
        print("warning: a seed diverged at its arm's chosen learning rate; it is left out of the summary")
        finals = {a: [v for v in values if v is not None] for a, values in finals.items()}
    summary = {a: spread(values) for a, values in finals.items()}
    claim, control = compare(finals["lamb_4B"], finals["adamw_B"]), compare(finals["adamw_4B"], finals["adamw_B"])
    wall = time.perf_counter() - start
    # CPU seconds of this process (all its threads): what the study costs whatever else shares the
    # machine; wall / (cpu / cores) says how contended it was.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime

    for a, s in summary.items():
        edge = "  (at the sweep's edge)" if at_edge[a] else ""
        print(f"{a:<9} lr {chosen[a]:<8g} final val loss {s['mean']:.4f} ± {s['std']:.4f} "
              f"(range {s['min']:.4f}-{s['max']:.4f}){edge}")
    print(f"LAMB@4B - AdamW@B = {claim['difference']:+.4f} (seed noise ±{claim['noise']:.4f}): claim "
          f"{'holds' if claim['not_worse'] else 'does not hold'}; AdamW@4B - AdamW@B = "
          f"{control['difference']:+.4f} (±{control['noise']:.4f}); {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU")

    cfg = arm_config(args, arms(args)[0], 1.0, 0)
    bench.write({
        "study": {"batch": args.batch, "large_batch": LARGE * args.batch, "seq_len": cfg.model.seq_len,
                  "tokens_per_run": LARGE * args.large_steps * args.batch * cfg.model.seq_len,
                  "steps": {a["arm"]: a["steps"] for a in arms(args)}, "warmup_share": args.warmup,
                  "lr_sweeps": {a["arm"]: a["lrs"] for a in arms(args)}, "seeds": args.seeds,
                  "dp": args.dp, "microbatches_4B": args.microbatches, "val_sequences": args.val_sequences,
                  "overrides": args.overrides, "model": cfg.to_dict()["model"],
                  "optim": {k: v for k, v in cfg.to_dict()["optim"].items() if k not in ("name", "lr", "warmup")},
                  "corpus": f"data.source={cfg.data.source}, {len(tokens):,} bytes"},
        "chosen_lr": chosen, "lr_at_sweep_edge": at_edge, "final_val_loss": summary,
        "claim_lamb_4B_vs_adamw_B": claim, "control_adamw_4B_vs_adamw_B": control,
        "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cpu_cores": os.cpu_count(),
        "load_average_5min": {"start": round(load_before, 2), "end": round(os.getloadavg()[1], 2)}, "runs": runs})
    png = os.path.splitext(path)[0] + ".png"
    plot(png, runs, chosen, summary, claim, control)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
