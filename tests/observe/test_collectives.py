"""Reading collectives out of HLO text: the three replica-group spellings, loop trip counts,
conditionals, async pairs and the bytes sent, on hand-written HLO with hand-computed answers."""

import types

import numpy as np
import pytest

from megascale_jax.observe import collectives as C

MESH = types.SimpleNamespace(devices=np.empty((2, 2, 2)), axis_names=("dp", "pp", "tp"))  # device = 4dp + 2pp + tp

HLO = """HloModule jit_train_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

%branch_head (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %ar.head = f32[4,8]{1,0} all-reduce(%p), channel_id=5, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(train_step)/shard_map/cond/branch_1_fun/pp_head/dot_general"}
}

%branch_idle (p: f32[4,8]) -> f32[4,8] {
  ROOT %p = f32[4,8]{1,0} parameter(0)
}

%body (t: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %send = f32[4,8]{1,0} collective-permute(%v), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1},{4,6},{6,4},{5,7},{7,5}}, metadata={op_name="ppermute"}
  %ag = bf16[4,16]{1,0} all-gather(%v), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_2'}, dimensions={1}, use_global_device_ids=true
  %pred = pred[] constant(true)
  %c = f32[4,8]{1,0} conditional(%pred, %send, %send), branch_computations={%branch_head, %branch_idle}
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[4,8])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], b: f32[4,8]) -> (s32[], f32[4,8]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[4,8]{1,0} parameter(1)
  %grads = (f32[4,8]{1,0}, f32[2]{0}) all-reduce(%a, %b), channel_id=3, replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %rs = f32[2,8]{1,0} reduce-scatter(%a), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  %start = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%a), channel_id=6, replica_groups=[2,4]<=[2,2,2]T(0,2,1), dimensions={0}, use_global_device_ids=true
  %done = f32[16,8]{1,0} all-gather-done(%start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %a)
  ROOT %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def by_op():
    return {c.op + ("/head" if c.in_branch else ""): c for c in C.collectives(HLO)}


def test_replica_groups_in_all_three_spellings():
    found = by_op()
    # iota [4,2]<=[8]: rows of arange(8) reshaped to 4x2
    assert found["all-reduce/head"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    # mesh over axis_2 (size 2) of a 2x2x2 iota: consecutive pairs
    assert found["all-gather"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    # device_ids [4,2]T(1,0) = 0,2,4,6,1,3,5,7 laid out as 1x2x4; groups along axis_1
    assert found["all-reduce"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert found["reduce-scatter"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert found["collective-permute"].groups[:2] == ((0, 2), (2, 0))


def test_async_collectives_are_read_at_their_done_with_the_starts_groups():
    gather = [c for c in C.collectives(HLO) if c.op == "all-gather" and c.nbytes == 16 * 8 * 4]
    assert len(gather) == 1
    # iota [2,2,2] transposed (0,2,1): 0,2,1,3,4,6,5,7 in rows of 4
    assert gather[0].groups == ((0, 2, 1, 3), (4, 6, 5, 7))


def test_bytes_sent_and_loop_trip_counts():
    found = by_op()
    assert found["all-reduce"].nbytes == 4 * 8 * 4 + 2 * 4  # a tuple's elements summed
    assert found["all-reduce"].sent_bytes == pytest.approx(2 * 1 / 2 * 136)
    assert found["reduce-scatter"].nbytes == 2 * 8 * 4 * 2  # its input: the result x the group
    assert found["reduce-scatter"].sent_bytes == pytest.approx(64)
    assert found["all-gather"].nbytes == 4 * 16 * 2  # bf16
    assert found["collective-permute"].sent_bytes == 128
    assert (found["collective-permute"].executions, found["all-gather"].executions) == (3, 3)
    assert (found["all-reduce/head"].executions, found["all-reduce"].executions) == (1, 1)


def test_bytes_per_axis_needs_to_know_how_often_a_branch_runs():
    with pytest.raises(ValueError, match="conditional"):
        C.bytes_per_axis(HLO, MESH)
    out = C.bytes_per_axis(HLO, MESH, {"pp_head": 5})
    tp = 136 + 3 * 64 + 5 * 128  # the tuple all-reduce, the looped all-gather (bf16 4x16, n=2), the branch 5 times
    assert out == {"tp": pytest.approx(tp), "dp": pytest.approx(64), "pp": pytest.approx(3 * 128),
                   "pp+tp": pytest.approx(3 / 4 * 512)}


def test_unknown_spellings_and_loops_are_refused():
    with pytest.raises(ValueError, match="replica groups"):
        C.replica_groups("channel_id=1, replica_groups=<something new>", 8)
    with pytest.raises(ValueError, match="trip count"):
        C.collectives(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
