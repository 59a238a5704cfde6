"""The pre-compile memory estimate (`model.flops.memory_estimate`, the train command's start-up
check) against the compiled peaks of bench/results/memory_estimate_aot.json: 17 layouts of gpt_1b
compiled for H100/H200s without a GPU (1 to 16 GPUs; tp, pp 1F1B and interleaved, dp, ZeRO-1,
remat policies, the loss in slices, a 16k sequence, LAMB and AdamW, the layer scan rolled and
unrolled). A change to the estimate changes no compiled program, so today's estimate is held
against the recorded compiles here, without the compile-only environment; tests/aot's compiles
hold the compile side on the layouts CI compiles."""

import json
import os

import pytest

from bench.aot import memory_estimate
from bench.common import REPO

ROWS = json.load(open(os.path.join(REPO, "bench", "results", "memory_estimate_aot.json")))["rows"]


def test_every_layout_of_the_bench_has_a_recorded_compile():
    assert set(ROWS) == set(memory_estimate.LAYOUTS) and len(ROWS) >= 12


@pytest.mark.parametrize("name", sorted(memory_estimate.LAYOUTS))
def test_the_estimate_is_within_5_percent_of_the_compiled_peak(name):
    gpu, gpus, overrides = memory_estimate.LAYOUTS[name]
    row = ROWS[name]
    assert (row["gpu"], row["gpus"]) == (gpu, gpus)
    assert memory_estimate.estimate_bytes(gpus, overrides) == pytest.approx(row["compiled_bytes"], rel=0.05)
