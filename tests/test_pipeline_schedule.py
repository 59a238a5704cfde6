"""Schedule tables: validity over random (p, v, m), bubble = closed form, memory flat in m."""

import dataclasses
import random
import subprocess
import sys

import pytest

from megascale_jax import pipeline_schedule as ps


def random_cases(n=60, seed=0):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        name = rng.choice(ps.SCHEDULES)
        p, v = rng.randint(2, 6), rng.randint(2, 4) if name == "interleaved_1f1b" else 1
        m = p * rng.randint(1, 5) if name == "interleaved_1f1b" else rng.randint(p if name == "1f1b" else 1, 24)
        cases.append((name, p, v, m))
    return cases


def independent_check(s: ps.Schedule):
    """Re-derive the properties from the raw table, without `ps.validate`."""
    p, v, m = s.stages, s.virtual, s.microbatches
    seen_f, seen_b = {}, {}
    for t in range(s.ticks):
        for stage in range(p):
            for table, seen in ((s.forward, seen_f), (s.backward, seen_b)):
                w = table[t][stage]
                if w is not None:
                    key = (w.mb, w.chunk * p + stage)
                    assert key not in seen
                    seen[key] = (t, stage, w.slot)
    assert len(seen_f) == len(seen_b) == m * p * v
    for (mb, g), (t, stage, _) in seen_f.items():
        assert stage == g % p  # chunk g lives on stage g mod p
        if g:
            assert seen_f[(mb, g - 1)][0] < t  # its input was produced earlier
        assert seen_b[(mb, g)][0] >= t  # backward not before forward
        if g < p * v - 1:
            assert seen_b[(mb, g)][0] > seen_b[(mb, g + 1)][0]  # cotangent produced earlier
    for stage in range(p):  # a slot is never handed out while still live
        intervals = [(seen_f[k][0], seen_b[k][0], seen_f[k][2]) for k in seen_f if seen_f[k][1] == stage]
        for a in intervals:
            for b in intervals:
                if a is not b and a[2] == b[2]:
                    assert a[1] < b[0] or b[1] < a[0]


@pytest.mark.parametrize("name,p,v,m", random_cases())
def test_random_tables_are_valid(name, p, v, m):
    s = ps.build(name, p, v, m)
    independent_check(s)
    assert s.bubble_fraction() == pytest.approx(ps.bubble_closed_form(p, v, m), abs=1e-12)


def test_validator_rejects_a_broken_table():
    s = ps.build("1f1b", 3, 1, 6)
    forward = [list(row) for row in s.forward]
    forward[0][0], forward[1][0] = forward[1][0], forward[0][0]  # swap two microbatches on stage 0
    with pytest.raises(AssertionError):
        ps.validate(dataclasses.replace(s, forward=tuple(map(tuple, forward))))


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (4, 2), (3, 3)])
def test_stash_is_flat_in_m_for_1f1b_and_grows_for_gpipe(p, v):
    name = "1f1b" if v == 1 else "interleaved_1f1b"
    slots = [ps.build(name, p, v, m).slots for m in (p * 2, p * 4, p * 8)]
    assert len(set(slots)) == 1 and slots[0] == (v + 1) * p - 1
    gpipe = [ps.build("gpipe", p, 1, m).slots for m in (p * 2, p * 4, p * 8)]
    assert gpipe == [p * 2, p * 4, p * 8]


def test_bad_inputs_are_one_line_errors():
    for args in [("1f1b", 4, 1, 3), ("interleaved_1f1b", 4, 2, 6), ("gpipe", 2, 2, 4), ("zigzag", 2, 1, 2)]:
        with pytest.raises(ValueError) as err:
            ps.build(*args)
        assert "\n" not in str(err.value)


def test_cli_prints_the_timeline():
    out = subprocess.run([sys.executable, "-m", "megascale_jax.pipeline_schedule", "--pp", "4", "--microbatches", "8",
                          "--schedule", "interleaved_1f1b", "--virtual", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "bubble=15.8%" in lines[0]  # (p-1)/(m v + p - 1) = 3/19
    stage0 = next(line for line in lines if line.startswith("stage 0"))
    assert stage0.split("|")[1].split()[:5] == ["F0a", "F1a", "F2a", "F3a", "F0b"]
    bad = subprocess.run([sys.executable, "-m", "megascale_jax.pipeline_schedule", "--pp", "4", "--microbatches", "2",
                          "--schedule", "1f1b"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("name,p,v,m", [("gpipe", 2, 1, 3), ("1f1b", 4, 1, 4), ("interleaved_1f1b", 4, 2, 8),
                                        ("interleaved_1f1b", 2, 3, 4)])
def test_forward_only_table_runs_every_chunk_once_in_order_with_no_backward(name, p, v, m):
    """Evaluation's table: every (microbatch, global chunk) forward exactly once, chunk g+1 of a
    microbatch exactly one tick after chunk g on the next stage (what the ring send delivers), in
    m·v + p − 1 ticks, with no backward and no stash."""
    s = ps.forward_only(ps.build(name, p, v, m))
    assert s.ticks == m * v + p - 1 and s.slots == 0
    assert all(w is None for row in s.backward for w in row)
    when = {}
    for t, row in enumerate(s.forward):
        for stage, w in enumerate(row):
            if w is not None:
                key = (w.mb, w.chunk * p + stage)
                assert key not in when
                when[key] = (t, stage)
    assert set(when) == {(mb, g) for mb in range(m) for g in range(p * v)}
    for (mb, g), (t, stage) in when.items():
        if g > 0:
            assert when[(mb, g - 1)] == (t - 1, (stage - 1) % p)
