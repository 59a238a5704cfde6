"""Peer copies of memory snapshots (training/peer_copy.py): two links in one process, each serving
its own host directory over loopback TCP — a copy sent arrives whole with its checksum, comes
back byte for byte, and a damaged, truncated or stale copy is refused; which step every process
can recover (two hosts lost with each other's copies: none, so the checkpoint)."""

import os

import numpy as np
import pytest

from megascale_jax.training import peer_copy


@pytest.fixture
def links(tmp_path):
    hosts = [tmp_path / "host_a", tmp_path / "host_b"]
    pair = [peer_copy.PeerLink(str(h), p, 2, keep=2, host=h.name) for p, h in enumerate(hosts)]
    for link in pair:
        link.join([other.record for other in pair])
    yield pair, hosts
    for link in pair:
        link.close()


def snapshot_file(directory, step, process=0, size=50_000):
    path = directory / str(step) / f"process_{process}-of-2.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(step).bytes(size))
    return path


def test_a_copy_goes_to_the_other_host_and_comes_back_byte_for_byte(links, tmp_path):
    (a, b), (host_a, host_b) = links
    assert a.holder() == 1 and b.holder() == 0
    own = snapshot_file(host_a, 7)
    assert a.send(7, str(own)) == "process 1 (host_b)"
    assert peer_copy.inventory(str(host_b), 2) == {0: [7]}
    assert (host_b / "7" / "peer_process_0-of-2.npz").read_bytes() == own.read_bytes()
    back = tmp_path / "fetched.npz"
    a.fetch(1, 0, 7, str(back))  # host a lost it: from the copy host b holds
    assert back.read_bytes() == own.read_bytes()


def test_the_holder_keeps_the_newest_steps_only(links):
    (a, b), (host_a, host_b) = links
    for step in (2, 4, 6):
        a.send(step, str(snapshot_file(host_a, step)))
    assert peer_copy.inventory(str(host_b), 2) == {0: [4, 6]}  # keep=2


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_copy_is_refused_and_leaves_no_file(links, tmp_path, damage):
    (a, b), (host_a, host_b) = links
    a.send(3, str(snapshot_file(host_a, 3)))
    copy = host_b / "3" / "peer_process_0-of-2.npz"
    data = bytearray(copy.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    copy.write_bytes(bytes(data))
    target = tmp_path / "fetched.npz"
    with pytest.raises(peer_copy.Refused, match="SHA-256"):
        a.fetch(1, 0, 3, str(target))
    assert not target.exists() and not os.path.exists(str(target) + ".tmp")


def test_a_missing_copy_is_refused(links, tmp_path):
    (a, b), _ = links
    with pytest.raises(peer_copy.Refused, match="no copy of step 9"):
        a.fetch(1, 0, 9, str(tmp_path / "fetched.npz"))


def test_a_stale_copy_is_refused():
    config = {"model": {"layers": 2}}
    peer_copy.check_meta({"step": 6, "config": config}, 6, config)
    with pytest.raises(peer_copy.Refused, match="stale: it holds step 4"):
        peer_copy.check_meta({"step": 4, "config": config}, 6, config)
    with pytest.raises(peer_copy.Refused, match="another config"):
        peer_copy.check_meta({"step": 6, "config": {"model": {"layers": 4}}}, 6, config)


def test_every_process_on_one_host_has_no_holder(tmp_path):
    pair = [peer_copy.PeerLink(str(tmp_path / f"p{p}"), p, 2, keep=2, host="same") for p in range(2)]
    try:
        for link in pair:
            link.join([other.record for other in pair])
        assert pair[0].holder() is None
        assert pair[0].send(1, str(snapshot_file(tmp_path / "p0", 1))) is None
    finally:
        for link in pair:
            link.close()


@pytest.mark.parametrize("reports,expected", [
    # (each process's inventory {owner: steps}, in process order) -> the step to restore
    ([{0: [3, 6]}, {1: [3, 6]}], 6),                    # every process has its own file
    ([{0: [3, 6], 1: [6]}, {}], 6),                     # host 1 lost: its file of 6 held by host 0
    ([{0: [3, 6]}, {1: [3]}], 3),                       # process 1 never wrote 6: the older step
    ([{2: [6]}, {}, {}, {}], None),                     # two hosts lost with each other's copies
    ([{0: [6], 1: [6]}, {}, {2: [6], 3: [6]}, {}], 6),  # hosts 1 and 3 lost, their peers hold them
])
def test_the_newest_step_every_process_can_recover(reports, expected):
    assert peer_copy.newest_recoverable(reports, len(reports)) == expected


def test_a_step_given_up_is_skipped():
    assert peer_copy.newest_recoverable([{0: [3, 6]}, {1: [3, 6]}], 2, skip={6}) == 3
