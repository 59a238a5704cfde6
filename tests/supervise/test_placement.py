"""Spares, eviction and shrinking, as tables (placement.py); the bad inputs `launch` refuses."""

import pytest

from megascale_jax.config import ConfigError, load_config
from megascale_jax.supervise import launch
from megascale_jax.supervise.placement import Placement, Shape, check_spares, grown, shrunk


def config(*overrides):
    return load_config(None, ["model.layers=2", *overrides])


def test_a_faulty_rank_gets_a_spare_until_none_is_left():
    p = Placement(nprocs=3, spares=1, host="h")
    assert p.hosts == ["h/slot0", "h/slot1", "h/slot2", "h/slot3"] and p.spares == [3]
    assert p.evict(1, "bad") == 1 and not p.complete
    assert p.replace() == [(1, 3)] and p.active == [0, 3, 2] and p.complete and p.spares == []
    p.evict(0, "bad again")
    assert p.replace() == [] and not p.complete and p.healthy() == 2
    p.shrink(2)
    assert p.active == [2, 3] and p.complete and p.excluded == {1: "bad", 0: "bad again"}


def test_leftover_healthy_processes_stand_by_after_a_shrink():
    p = Placement(nprocs=4, spares=0, host="h")
    p.evict(2, "bad")
    p.shrink(2)  # dp 4 -> 2 needs 2 processes of the 3 healthy ones
    assert p.active == [0, 1] and p.spares == [3]


@pytest.mark.parametrize("mesh, batch, nprocs, healthy, expected", [
    # 1 device per process, rows 2: dp 3 would need 8 % 6 == 0; dp 2 with 2 microbatches
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 8, 4, 3, Shape(2, 2, 2)),
    # rows 3: dp 3 would need 12 % 9 == 0; dp 2 with 2 microbatches
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 12, 4, 3, Shape(2, 2, 2)),
    # tp=2, one replica per process, rows 2: dp 3 would need 8 % 6 == 0
    (["mesh.dp=4", "mesh.tp=2", "mesh.pp=1"], 8, 4, 3, Shape(2, 2, 2)),
    # rows 4: dp 2 would need 12 % 8 == 0; dp 1 with 3 microbatches on 1 process
    (["mesh.dp=3", "mesh.tp=2", "mesh.pp=1"], 12, 3, 2, Shape(1, 1, 3)),
    # 2 devices per process: dp 3 is no whole number of processes; dp 2 on 1 process
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 16, 2, 1, Shape(1, 2, 2)),
    # a replica is pp x cp x tp devices: cp 2, one replica per process; dp 2 on 2 processes (not 1)
    (["mesh.dp=4", "mesh.cp=2", "mesh.tp=1", "mesh.pp=1"], 8, 4, 3, Shape(2, 2, 2)),
])
def test_the_shrunk_shape_keeps_the_global_batch_and_the_rows_per_microbatch(mesh, batch, nprocs, healthy, expected):
    cfg = config(*mesh, f"train.global_batch={batch}")
    shape = Shape(nprocs, cfg.mesh.dp, 1)
    got = shrunk(cfg, shape, healthy, cfg.mesh.size // nprocs)
    rows = batch // cfg.mesh.dp  # per microbatch per replica, before
    assert got == expected
    assert got.dp * got.microbatches * rows == batch
    assert got.dp * cfg.mesh.pp * cfg.mesh.cp * cfg.mesh.tp == got.nprocs * (cfg.mesh.size // nprocs)


@pytest.mark.parametrize("mesh, batch, shape, healthy, expected", [
    # dp 4 shrunk to 2 (2 rows a microbatch, 2 microbatches): 4 healthy processes grow it back whole
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 8, Shape(2, 2, 2), 4, Shape(4, 4, 1)),
    # 3 healthy: dp 3 would need 8 % 6 == 0, so nothing larger than dp 2
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 8, Shape(2, 2, 2), 3, None),
    # rows 2, batch 12, dp 1 x 6 microbatches: 2 healthy processes hold dp 2 x 3 (dp 3 needs 3)
    (["mesh.dp=4", "mesh.tp=1", "mesh.pp=1"], 12, Shape(1, 1, 6), 2, Shape(2, 2, 3)),
    # 2 devices per process (tp 2): dp 2 x 2 microbatches back to dp 4 on 4 processes
    (["mesh.dp=4", "mesh.tp=2", "mesh.pp=1"], 16, Shape(2, 2, 2), 5, Shape(4, 4, 1)),
    # never past the configured dp, however many slots are healthy
    (["mesh.dp=2", "mesh.tp=1", "mesh.pp=1"], 8, Shape(2, 2, 1), 6, None),
])
def test_the_grown_shape_is_the_largest_the_healthy_slots_hold_up_to_the_configured_dp(mesh, batch, shape, healthy,
                                                                                      expected):
    cfg = config(*mesh, f"train.global_batch={batch}")
    per_process = cfg.mesh.tp * cfg.mesh.pp  # one replica per process in these cases
    got = grown(cfg, shape, healthy, per_process)
    assert got == expected
    if got is not None:  # the same rows a microbatch per replica, the same global batch
        rows = batch // (shape.dp * shape.microbatches)
        assert got.dp * got.microbatches * rows == batch


def test_a_returned_slot_stands_by_and_a_grow_gives_it_the_new_ranks():
    p = Placement(nprocs=2, spares=0, host="h")
    p.evict(1, "bad")
    p.shrink(1)
    assert p.active == [0] and p.spares == []
    assert p.readmit("h/slot0") is None and p.readmit("elsewhere") is None  # not excluded / not ours
    assert p.readmit("h/slot1") == 1 and p.excluded == {} and p.spares == [1]
    p.grow(2)
    assert p.active == [0, 1] and p.spares == []


def test_the_return_drill_gives_back_the_first_excluded_slot_and_holds_a_shrunk_job_past_a_snapshot(tmp_path):
    from megascale_jax import run_dir as run_dirs
    from megascale_jax.supervise.drills import Drill, Drills

    cfg = config("checkpoint.memory_every=4")
    drills = Drills([Drill.parse("return@6")], cfg, str(tmp_path))
    assert "MEGASCALE_FAULT_HOLD" not in drills.attempt_env()  # not shrunk: nothing to grow, nobody waits
    # shrunk: rank 0 waits before step 9, after the snapshot of step 8 (the first at or past 6 + 2)
    assert drills.attempt_env(shrunk=True)["MEGASCALE_FAULT_HOLD"] == "0:9"
    placement = Placement(2, 0, host="h")
    assert drills.fire(FakeGroup(), {}, 7, placement, 2, None, 0.0) is None  # nothing excluded yet: it waits
    placement.evict(1, "bad")
    placement.evict(0, "bad too")
    drills.lost_slots.add(0)
    fired = drills.fire(FakeGroup(), {}, 7, placement, 2, None, 0.0)
    assert fired["drill"] == "return" and fired["host"] == "h/slot0" and drills.pending == []
    with open(run_dirs.returned_hosts_path(str(tmp_path))) as f:
        assert f.read() == "h/slot0\n"
    drills.repaired(0)
    assert drills.lost_slots == set()


def test_a_mesh_that_cannot_shrink_is_refused():
    with pytest.raises(ConfigError, match="mesh.dp=1 cannot shrink"):
        shrunk(config("mesh.dp=1", "mesh.tp=2"), Shape(2, 1, 1), 1, 1)
    # pp=3 with 2 devices per process: one replica is 1.5 processes, so dp=1 is no whole number of them
    cfg = config("mesh.dp=2", "mesh.pp=3", "mesh.tp=1", "model.layers=6", "train.global_batch=8",
                 "parallel.microbatches=4")
    with pytest.raises(ConfigError, match="cannot shrink mesh.dp=2 onto 2 healthy process.*global_batch=8"):
        shrunk(cfg, Shape(3, 2, 4), 2, 2)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.dp=1", "mesh.tp=2"], "error: mesh.dp=1 cannot shrink: there is no data-parallel replica to drop; set "
                                 "supervisor.on_no_spare=stop"),
    (["mesh.dp=2", "mesh.pp=3", "mesh.tp=1", "model.layers=6", "train.global_batch=8", "mesh.cpu_devices=6",
      "parallel.microbatches=4"],
     "error: cannot shrink mesh.dp=2 onto 2 healthy process(es)"),
])
def test_launch_refuses_spares_it_could_not_use_in_one_line(overrides, message, tmp_path, run_main):
    nprocs = "3" if "mesh.pp=3" in overrides else "2"
    code, out, err = run_main(launch.main, ["--nprocs", nprocs, "--spares", "1", "--run-dir", "run", *overrides],
                              tmp_path)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything was started or written


def test_spares_need_a_shrinkable_mesh_only_when_they_may_shrink():
    cfg = config("mesh.dp=1", "mesh.tp=2")
    check_spares(cfg, 2, 0)  # no spares asked for: a fault with no spare gives up then, if it must
    with pytest.raises(ConfigError, match="mesh.dp=1 cannot shrink"):
        check_spares(cfg, 2, 1)
    check_spares(config("mesh.dp=1", "mesh.tp=2", "supervisor.on_no_spare=stop"), 2, 1)
    with pytest.raises(ConfigError, match="--spares=-1 must be >= 0"):
        check_spares(cfg, 2, -1)


# ============================================================================ drills


class FakeGroup:
    def __init__(self):
        self.sent = []

    def signal(self, rank, sig):
        self.sent.append((rank, sig))


def test_drills_fire_in_order_at_their_step_or_time_and_remember_broken_and_slow_slots():
    import signal

    from megascale_jax.supervise.drills import Drill, Drills

    drills = Drills([Drill.parse("faulty:1@3"), Drill.parse("slow:0@t5"), Drill.parse("nan:1@t6")], config(), "run")
    drills.started = 100.0
    placement, group, training = Placement(2, 1, host="h"), FakeGroup(), {0: {"state": "training"}}
    assert drills.attempt_env() == {"MEGASCALE_FAULT_NAN": "usr1", "MEGASCALE_FAULT_SLOW": "usr2:0.5",
                                    "MEGASCALE_FAULT_HOLD": "1:5"}
    assert drills.fire(group, training, 2, placement, 2, None, 200.0) is None  # step 2 < 3
    fired = drills.fire(group, training, 3, placement, 2, None, 100.0)
    assert fired["drill"] == "faulty" and group.sent == [(1, signal.SIGKILL)] and drills.broken_slots == {1}
    assert drills.diagnosis_env(placement) == {"MEGASCALE_DIAG_FAULT": "1"}
    placement.evict(1, "broken")
    placement.replace()  # the spare (slot 2) takes rank 1: no broken slot runs any more
    assert drills.diagnosis_env(placement) == {}
    assert drills.fire(group, training, 9, placement, 2, None, 104.0) is None  # 4 s < 5 s
    assert drills.fire(group, training, 9, placement, 2, None, 105.0)["drill"] == "slow"
    drills.slow_down(group, training, placement)
    drills.slow_down(group, training, placement)  # once per attempt
    assert group.sent[-1] == (0, signal.SIGUSR2) and len(group.sent) == 2
    # rank 1 is not training yet: its SIGUSR1 handler is not installed, the nan drill waits
    assert drills.fire(group, training, 9, placement, 2, None, 107.0) is None
    fired = drills.fire(group, {**training, 1: {"state": "training"}}, 9, placement, 2, None, 107.0)
    assert fired["drill"] == "nan" and group.sent[-1] == (1, signal.SIGUSR1) and drills.pending == []
    assert drills.attempt_env() == {"MEGASCALE_FAULT_SLOW": "usr2:0.5"}  # slot 0 stays slow


def test_the_next_drill_that_ends_a_process_at_a_step_holds_that_process_two_steps_on(tmp_path):
    """`host:1@9` fires when the heartbeats report step 9 (made one step late, with step 10's
    dispatch): rank 1 waits before step 11 until it fires, so the loss lands at step 9 however
    late a loaded machine's driver polls (a restart from step 18 once failed the spare drill)."""
    from megascale_jax.cluster import faults
    from megascale_jax.supervise.drills import Drill, Drills

    cfg = load_config(None, [])
    drills = Drills([Drill.parse("nan:1@3"), Drill.parse("host:1@9"), Drill.parse("kill:0@t30")], cfg, str(tmp_path))
    env = drills.attempt_env()
    assert env["MEGASCALE_FAULT_HOLD"] == "1:11" and env["MEGASCALE_FAULT_NAN"] == "1:3"
    drills.pending.pop(1)  # fired: a timed drill is not held
    assert "MEGASCALE_FAULT_HOLD" not in drills.attempt_env()
    slept = []
    hold = faults.HoldProcess(11, limit_s=0.01, sleep=slept.append)
    for step in (10, 11, 12):
        hold.before_step(step)
    assert slept == [0.01]  # before step 11 only
