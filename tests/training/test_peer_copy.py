"""Peer copies of memory snapshots (training/peer_copy.py): two links in one process, each serving
its own host directory over loopback TCP — a copy sent arrives whole with its checksum, comes
back byte for byte, and a damaged, truncated or stale copy is refused; which step every process
can recover (two hosts lost with each other's copies: none, so the checkpoint). And attacks from
outside the job (no key, a forged checksum, a replay, bad headers): each refused, one log line,
nothing written."""

import hashlib
import hmac
import json
import os
import socket
import time

import numpy as np
import pytest

from megascale_jax import job_key
from megascale_jax.training import peer_copy

KEY = hmac.new(b"the job's secret", job_key.LABEL, hashlib.sha256).digest()


@pytest.fixture
def links(tmp_path):
    hosts = [tmp_path / "host_a", tmp_path / "host_b"]
    pair = [peer_copy.PeerLink(str(h), p, 2, keep=2, key=KEY, host=h.name) for p, h in enumerate(hosts)]
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
    # the size and the checksum are the ones the owner signed: a truncated copy falls short of them
    with pytest.raises(peer_copy.Refused, match="SHA-256" if damage == "flipped" else "partial: 25000 of 50000"):
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
    pair = [peer_copy.PeerLink(str(tmp_path / f"p{p}"), p, 2, keep=2, key=KEY, host="same") for p in range(2)]
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


# ------------------------------------------------------------------ attacks from outside the job


def ask(link, header, body: bytes = b"") -> dict:
    """One raw request to `link`'s server, as an outside client would send it: its reply."""
    host, port = json.loads(link.record)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall((header if isinstance(header, bytes) else json.dumps(header).encode() + b"\n") + body)
        conn.shutdown(socket.SHUT_WR)  # the server reads the rest of a refused request before closing
        return json.loads(conn.makefile("rb").readline() or b"{}")


@pytest.fixture
def server_log(monkeypatch):
    """The peer-copy server's warnings, as its logger is given them (pytest's caplog sees nothing
    once another test's logging set-up stops the package logger's propagation)."""
    lines = []
    monkeypatch.setattr(peer_copy.logger, "warning", lambda message, *a, **k: lines.append(message))
    return lines


def refusals(server_log) -> list[str]:
    return [line for line in server_log if "refused a request" in line]


def test_a_client_without_the_key_can_neither_read_nor_write_a_snapshot(links, server_log):
    """The attack of issue 63, as it was: a bare get of process 0's snapshot, and a put of a forged
    file for process 1 with a SHA-256 the client computed itself. Both refused, one log line each,
    nothing stored; the job's own copy still goes and comes back."""
    (a, b), (host_a, host_b) = links
    own = snapshot_file(host_a, 5)
    reply = ask(a, {"op": "get", "owner": 0, "step": 5, "processes": 2})
    assert reply == {"error": "refused: not signed with the job's key"}
    forged = b"forged state" * 100
    digest = hashlib.sha256(forged).hexdigest()
    reply = ask(b, {"op": "put", "owner": 1, "step": 5, "processes": 2, "size": len(forged), "sha256": digest,
                    "time": time.time(), "nonce": "n", "mac": "0" * 64}, forged)
    assert reply == {"error": "refused: not signed with the job's key"}
    assert peer_copy.inventory(str(host_b), 2) == {}  # nothing stored
    assert len(refusals(server_log)) == 2 and all("nothing written" in m for m in refusals(server_log))
    a.send(5, str(own))
    assert (host_b / "5" / "peer_process_0-of-2.npz").read_bytes() == own.read_bytes()


def test_a_replayed_or_stale_request_is_refused(links, server_log):
    (a, b), (host_a, host_b) = links
    own = snapshot_file(host_a, 6)
    header = a.request({"op": "put", "owner": 0, "step": 6, "processes": 2, "size": own.stat().st_size,
                        "sha256": peer_copy.sha256_file(str(own))})
    assert ask(b, header, own.read_bytes()) == {"ok": True}
    os.remove(host_b / "6" / "peer_process_0-of-2.npz")
    assert ask(b, header, own.read_bytes()) == {"error": "refused: a replay of a request already served"}
    old = job_key.signed(KEY, {**header, "time": time.time() - 10 * peer_copy.REPLAY_WINDOW_S, "nonce": "fresh"})
    assert ask(b, old, own.read_bytes())["error"].startswith("refused: sent ")
    assert not (host_b / "6" / "peer_process_0-of-2.npz").exists() and len(refusals(server_log)) == 2


@pytest.mark.parametrize("request_bytes,reason", [
    (b"not json\n", "a header that is not JSON"),
    (b"{" + b" " * (peer_copy.MAX_HEADER + 10) + b"}\n", "a header over"),
    (b'["get", 0]\n', "not a request of this protocol"),
])
def test_a_bad_header_is_one_line_and_the_connection_closed(links, server_log, request_bytes, reason):
    (a, _), _ = links
    assert ask(a, request_bytes)["error"].startswith(f"refused: {reason}")
    assert len(refusals(server_log)) == 1 and reason in refusals(server_log)[0]


def test_a_signed_put_for_a_process_the_job_does_not_have_is_refused(links, server_log):
    (a, b), (host_a, host_b) = links
    body = b"x" * 10
    header = a.request({"op": "put", "owner": 7, "step": 1, "processes": 2, "size": len(body),
                        "sha256": hashlib.sha256(body).hexdigest()})
    assert "no process 7" in ask(b, header, body)["error"]
    assert peer_copy.inventory(str(host_b), 2) == {} and any("no process 7" in m for m in refusals(server_log))


def test_a_restore_checks_the_checksum_its_owner_signed_not_one_a_server_sends(links, tmp_path):
    """A holder whose record of a copy was rewritten (a forged checksum matching a forged file, no
    valid MAC): the restore refuses it. A copy fetched from a server of another job (another key)
    likewise."""
    (a, b), (host_a, host_b) = links
    a.send(8, str(snapshot_file(host_a, 8)))
    copy = host_b / "8" / "peer_process_0-of-2.npz"
    record_path = str(copy) + peer_copy.RECORD
    record = json.loads(open(record_path).read())
    forged = b"forged" * 1000
    copy.write_bytes(forged)
    record.update(size=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    with open(record_path, "w") as f:
        json.dump(record, f)
    with pytest.raises(peer_copy.Refused, match="not signed with the job's key"):
        a.fetch(1, 0, 8, str(tmp_path / "fetched.npz"))
    assert not (tmp_path / "fetched.npz").exists()
    stranger = peer_copy.PeerLink(str(tmp_path / "other_job"), 1, 2, keep=2, key=b"another job's key" * 2, host="c")
    try:
        stranger.join([a.record, stranger.record])
        snapshot_file(tmp_path / "other_job", 9, process=1)
        a.join([a.record, stranger.record])
        with pytest.raises(peer_copy.Refused, match="no copy|not signed"):
            a.fetch(1, 1, 9, str(tmp_path / "fetched.npz"))  # the stranger refuses a's request first
    finally:
        stranger.close()


def test_the_server_listens_where_the_others_reach_it_not_on_every_interface(links):
    (a, _), _ = links
    assert a.server.server_address[0] != "0.0.0.0"
    assert json.loads(a.record)[1] == f"{a.server.server_address[0]}:{a.server.server_address[1]}"


def test_a_truncated_put_stores_nothing(links, server_log):
    """A signed put whose body stops short of the size it announced (a sender killed mid-copy):
    nothing is kept, the server logs it, the sender reads why."""
    (a, b), (host_a, host_b) = links
    body = b"y" * 1000
    header = a.request({"op": "put", "owner": 0, "step": 2, "processes": 2, "size": 2 * len(body),
                        "sha256": hashlib.sha256(body * 2).hexdigest()})
    assert "partial or damaged in transit (1000 of 2000 bytes)" in ask(b, header, body)["error"]
    assert peer_copy.inventory(str(host_b), 2) == {} and not list(host_b.rglob("*.tmp"))
    assert len(refusals(server_log)) == 1
