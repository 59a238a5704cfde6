"""The tables the campaign prints last: one line per section, then each section's numbers."""

from __future__ import annotations

from bench.campaign import claims as claims_module
from megascale_jax.model.flops import format_bytes


def number(value, spec: str, width: int) -> str:
    """`value` formatted with `spec`, right-aligned in `width`; 'n/a' for None."""
    return f"{'n/a' if value is None else format(value, spec):>{width}}"


def outcome(row: dict) -> str:
    """A row's one-line reason when it has no numbers."""
    return row.get("error") or row.get("skipped") or ""


def kernels(section: dict) -> None:
    print("attention fwd+bwd, bf16 (TFLOP/s of the useful FLOPs; rel_err of the forward vs float32)")
    print(f"{'seq':>7}{'window':>8}  {'contender':<18}{'ms':>10}{'fwd ms':>9}{'TFLOP/s':>9}{'rel_err':>9}  blocks")
    for r in section["attention"]:
        head = f"{r['seq']:>7}{str(r['window']):>8}  {r['contender']:<18}"
        if "ms" not in r:
            print(f"{head}  {outcome(r)}")
            continue
        blocks = "x".join(map(str, r["blocks"])) if "blocks" in r else ""
        print(f"{head}{r['ms']:>10.3f}{number(r.get('forward_ms'), '.3f', 9)}{r['tflops']:>9.2f}"
              f"{number(r.get('rel_err'), '.1e', 9)}  {blocks}")
    print(f"\n{'fused kernel fwd+bwd':<22}{'impl':<8}{'ms':>10}")
    for r in section["fused"]:
        print(f"{r['kernel']:<22}{r['impl']:<8}" + (f"{r['ms']:>10.3f}" if "ms" in r else f"  {outcome(r)}"))


def ladder(section: dict, torch_peer: dict | None) -> None:
    peers = {p["row"]: p for p in (torch_peer or {}).get("rows", [])}
    print(f"MFU ladder ({section['config']}, window {section['window']}; peak and estimate per device)")
    print(f"{'row':<20}{'batch':>6}{'tokens/s':>11}{'MFU':>7}{'peak':>11}{'estimate':>11}{'torch tok/s':>13}")
    for r in section["rows"]:
        batch = f"{r['batch']}x{r['microbatches']}" if r.get("batch") and r["microbatches"] > 1 else r.get("batch")
        estimate = f"{format_bytes(r['estimate_bytes']) if r.get('estimate_bytes') else 'n/a':>11}"
        if "tokens_per_s" not in r:
            print(f"{r['name']:<20}{str(batch):>6}{'':>29}{estimate}  {outcome(r)}")
            continue
        peak = r.get("peak_bytes_in_use")
        peer = peers.get(r["name"], {})
        print(f"{r['name']:<20}{str(batch):>6}{r['tokens_per_s']:>11.0f}{number(r['mfu'], '.1%', 7)}"
              f"{format_bytes(peak) if peak else 'n/a':>11}{estimate}"
              f"{number(peer.get('tokens_per_s'), '.0f', 13) if peer else ''}"
              + (f"  ({outcome(peer)})" if peer and outcome(peer) else ""))
    same_tokens = [p for p in peers.values() if "losses" in p]  # peers before 2026-11-25 trained on one batch
    if same_tokens:
        measured_rows = [r for r in section["rows"] if "tokens_per_s" in r]

        def ours(peer: dict) -> dict:
            """Our row of the peer's name, else our fastest row doing its work (window, batch)."""
            named = next((r for r in measured_rows if r["name"] == peer["row"]), None)
            return named or claims_module.fastest(claims_module.same_work(measured_rows, peer["window"], peer["batch"])) or {}

        pairs = [(p, ours(p)) for p in same_tokens]
        print("PyTorch peer on the same token rows: " + "; ".join(
            f"{p['row']} ({p['family']}, {p['attention']}): loss after {p['steps']} steps {p['final_loss']:.4f}, "
            f"ours ({mine.get('name', 'no row')}) {number(mine.get('final_loss'), '.4f', 0)}" for p, mine in pairs))


def levers(section: dict) -> None:
    base = section["base"]
    print(f"levers, each alone on the base ({', '.join(f'{k}={v}' for k, v in section['config'].items())}; "
          f"XLA flags {' '.join(section['xla_flags']) or 'none'})")
    print(f"{'lever':<21}{'batch':>6}{'tokens/s':>11}{'change':>9}")
    for r in [base, *section["rows"]]:
        if "tokens_per_s" not in r:
            print(f"{r['name']:<21}{str(r.get('batch')):>6}  {outcome(r)}")
            continue
        change = f"{r['delta_pct']:+.1f}%" if "delta_pct" in r else ""
        print(f"{r['name']:<21}{str(r['batch']):>6}{r['tokens_per_s']:>11.0f}{change:>9}")


def checkpoints(section: dict) -> None:
    print(f"checkpoints (median of {section['repeats']}; background: checkpoint.background_host_copy=true, "
          "blocking = dispatch + the device copy)")
    print(f"{'host copy':<12}{'state GB':>9}{'block s':>10}{'total s':>10}{'block/total':>13}{'restore s':>11}")
    for mode, key in (("in save()", "sizes"), ("background", "background_sizes")):
        for r in section.get(key, []):  # results before 2026-11-24 have no background_sizes
            if "total_s" not in r:
                print(f"{mode:<12}{r['state_gb']:>9.2f}  {outcome(r)}")
                continue
            print(f"{mode:<12}{r['state_gb']:>9.2f}{r['block_s']:>10.3f}{r['total_s']:>10.3f}"
                  f"{r['block_fraction']:>13.1%}{r['restore_s']:>11.3f}")


def profiled(section: dict) -> None:
    compute = ", ".join(f"{s * 1e3:.1f}" for s in section["device_compute_s"][0])
    print(f"profiled steps {section['profiled_steps']} on devices {section['devices']}: device 0 compute ms "
          f"[{compute}]; heat map {section['device_heatmap']}")
    if "op_table_error" in section:
        print(f"where the step's device time goes: {section['op_table_error']}")
    if "top_ops" not in section:  # results before the op table, or its error
        return
    table, total = section["op_table"], section["by_part"]["total"]
    config = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in table["config"].items())
    print(f"\nwhere the step's device time goes ({config}; batch {table['batch']}; "
          f"{total * 1e3:.2f} ms of ops per step, device busy {table['busy_s'] * 1e3:.2f} ms)")
    split = section.get("batch_split")
    half = section.get("by_part_half_batch")
    columns = f"{'at ' + str(half['batch']):>10}{'per step':>10}{'per seq':>10}" if half else ""
    print(f"{'part':<24}{'ms/step':>10}{'share':>8}{columns}")
    for part, seconds in section["by_part"].items():
        if part != "total":
            line = f"{part:<24}{seconds * 1e3:>10.3f}{seconds / total:>8.1%}"
            if half:  # the same part at half the batch, and the line through both (profile.batch_split)
                line += (f"{half['by_part'].get(part, 0.0) * 1e3:>10.3f}{split[part]['per_step_s'] * 1e3:>10.3f}"
                         f"{split[part]['per_sequence_s'] * 1e3:>10.3f}")
            print(line)
    if isinstance(split, str):
        print(f"per step and per sequence: {split}")
    products = section.get("products") or {}
    if products.get("tflop_per_s"):
        print(f"matrix products: {products['flops'] / 1e12:.2f} TFLOP in {products['seconds'] * 1e3:.2f} ms a step, "
              f"{products['tflop_per_s']:.1f} TFLOP/s ({products['ops']} ops)")
    print(f"\n{'top op':<40}{'part':<24}{'ms/step':>10}{'share':>8}{'TFLOP/s':>9}  op_name")
    for r in section["top_ops"]:
        print(f"{r['op'][:39]:<40}{r['part']:<24}{r['seconds'] * 1e3:>10.3f}{r['share']:>8.1%}"
              f"{number(r.get('tflop_per_s'), '.1f', 9)}  {r['op_name'][-60:]}")


def rates(section: dict) -> None:
    """GEMM device time by shape and the streaming HBM rate (campaign section `rates`)."""
    print(f"GEMMs, bf16, device time per call ({section['repeats']} traced calls each)")
    print(f"{'m':>7}{'k':>7}{'n':>7}{'us':>11}{'TFLOP/s':>9}")
    for r in section["gemms"]:
        timing = f"{r['seconds'] * 1e6:>11.1f}{r['tflops']:>9.1f}" if "seconds" in r else f"  {r['error']}"
        print(f"{r['m']:>7}{r['k']:>7}{r['n']:>7}{timing}")
    bf16 = {(r["m"], r["k"], r["n"]): r for r in section["gemms"] if "seconds" in r}
    for r in section.get("fp8_gemms", []):  # results before 2026-11-28 have none
        if "seconds" not in r:
            print(f"fp8 {r['which']:<16}{r['m']:>7}{r['k']:>7}{r['n']:>7}  {r['error']}")
            continue
        same = bf16.get((r["m"], r["k"], r["n"]))
        print(f"fp8 {r['which']:<16}{r['m']:>7}{r['k']:>7}{r['n']:>7}{r['seconds'] * 1e6:>11.1f}{r['tflops']:>9.1f}"
              + (f"  {r['tflops'] / same['tflops']:.2f}x bf16" if same else "")
              + ("" if r["fp8_gemm"] else f"  ({r['note']})"))
    print("stream (2x + 1, float32): " + "; ".join(
        f"{r['bytes'] / 2**20:.0f} MiB " + (f"{r['tb_per_s']:.2f} TB/s" if "seconds" in r else r["error"])
        for r in section["stream"]))
    c = section.get("concurrency", {})
    if "hidden_share" in c:
        print(f"a GEMM and a softmax on two streams: {c['gemm_s'] * 1e3:.3f} + {c['softmax_s'] * 1e3:.3f} ms alone, "
              f"{c['both_s'] * 1e3:.3f} ms at once: {c['hidden_share']:.0%} of the shorter hidden")
    elif c:
        print(f"a GEMM and a softmax on two streams: {c.get('skipped') or c.get('error')}")


def show(sections: dict, pngs: list[str], problems: list[str]) -> None:
    print(f"{'section':<16}{'status':<9}{'seconds':>8}  note")
    for name, s in sections.items():
        print(f"{name:<16}{s['status']:<9}{s['seconds']:>8.1f}  {s.get('reason', '')}")
    ok = {name: s for name, s in sections.items() if s["status"] == "ok"}
    tables = {"kernels": lambda: kernels(ok["kernels"]),
              "mfu_ladder": lambda: ladder(ok["mfu_ladder"], ok.get("torch_peer")),
              "levers": lambda: levers(ok["levers"]),
              "checkpoints": lambda: checkpoints(ok["checkpoints"]),
              "profiled_steps": lambda: profiled(ok["profiled_steps"]),
              "rates": lambda: rates(ok["rates"])}
    for name, table in tables.items():
        if name in ok:
            print()
            table()
    if "torch_peer" in ok and "mfu_ladder" not in ok:  # otherwise its column is in the ladder's table
        print("\nPyTorch peer: " + "; ".join(
            f"{p['row']} ({p['family']}): "
            + (f"{p['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in p else outcome(p))
            for p in ok["torch_peer"]["rows"]))
    print("\nPNGs: " + (", ".join(pngs) if pngs else "none") + "".join(f"\n  not drawn: {p}" for p in problems))


def claims(summary: dict) -> None:
    """The result's top-level summary, one key a line ('n/a': not measured in this run)."""
    print("\nsummary (issue 36's claims)")
    for key, value in summary.items():
        text = "n/a" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        print(f"  {key:<32}{text}")
