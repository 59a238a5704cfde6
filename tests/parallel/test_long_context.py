"""Context parallelism over a sequence long enough for banded attention (each rank's slice at
least four blocks of >= window - 1 queries): cp 4 on 4 devices against one device, through
bench/parallel/long_context.py's own measurement (the train step compiled for each, trained from
the same state on the same batch). The losses after three updates agree (float32) and a cp rank's
compiled temporaries are about 1/4 of one device's: the activations are what cp divides."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.parallel import long_context  # noqa: E402


@pytest.mark.slow
def test_a_long_sequence_split_over_cp_trains_like_one_device_in_a_quarter_of_its_memory():
    split, whole = (long_context.measure(1024, 64, cp, steps=1) for cp in (4, 1))
    assert split["positions_per_device"] == 256  # four blocks of 64: banded on each rank, as on one device
    assert split["loss_after_warm_up"] == pytest.approx(whole["loss_after_warm_up"], rel=1e-6)
    assert split["compiled_temp_bytes"] < 0.3 * whole["compiled_temp_bytes"]
