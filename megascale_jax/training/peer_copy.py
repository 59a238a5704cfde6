"""Peer copies of memory snapshots: each process's snapshot file is also held in the RAM of another
host, so that when a machine is lost, its processes' state comes back from a peer, not from disk.

Why: a snapshot (training/snapshot.py) lives in its host's /dev/shm and dies with the machine —
the commonest fault at scale — and the job then fell back to the last disk checkpoint, redoing
every step since. Gemini (SOSP '23) and ByteRobust keep checkpoints in peers' CPU memory for this.

Who holds whose: process i's copy goes to the next process in rank order that runs on another
host (ring order: a data-parallel peer at pp = tp = 1). A host is named by `MEGASCALE_HOST` (the
local launcher sets each worker's slot, `<hostname>/slot<k>`, so that slots stand for machines),
else by the machine's hostname. With every process on one host there is no peer, and no copy.

Transport: every process serves its host's snapshot directory over TCP (a thread; the addresses
are exchanged once, through jax.distributed's key-value store: `join`), and the snapshot writer thread sends each new
file to its holder after writing it — in the background, off the training step. The holder
keeps it as `peer_process_<i>-of-<n>.npz` beside its own files, with its SHA-256 in a sidecar,
and keeps the newest `snapshot.KEEP` steps of each owner.

A copy is refused (the caller warns once and uses the next source: a local snapshot, then disk)
when it is partial (fewer bytes than announced), fails its checksum, or is stale (another step,
another config, another owner than asked for: `check_meta`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import socketserver
import threading

from megascale_jax.run_dir import HOST_ENV, SNAPSHOT_FILE, committed_steps

TIMEOUT_S = 60.0  # one transfer; a holder that does not answer in this long is no source


class Refused(Exception):
    """A peer copy that must not be restored from: partial, failing its checksum, or stale."""


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inventory(directory: str, processes: int) -> dict[int, list[int]]:
    """{owner process: [steps]} of every snapshot file (its own or a peer copy) in `directory`."""
    held: dict[int, list[int]] = {}
    for step in committed_steps(directory):
        for name in os.listdir(os.path.join(directory, str(step))):
            match = SNAPSHOT_FILE.match(name)
            if match and int(match.group(2)) == processes:
                held.setdefault(int(match.group(1)), []).append(step)
    return held


def newest_recoverable(reports: list[dict[int, list[int]]], processes: int, skip: set[int] = frozenset()) -> int | None:
    """The newest step of which every process's file exists somewhere (each process's
    `inventory`, in process order), not in `skip`; None when there is none — the checkpoint."""
    found = [set().union(*[r.get(p, []) for r in reports]) - set(skip) for p in range(processes)]
    common = set.intersection(*found) if found else set()
    return max(common) if common else None


def copy_name(owner: int, processes: int) -> str:
    return f"peer_process_{owner}-of-{processes}.npz"


def check_meta(meta: dict, step: int, config: dict) -> None:
    """A copy's own record against what was asked for: the step and the exact config."""
    if meta.get("step") != step:
        raise Refused(f"stale: it holds step {meta.get('step')}, not step {step}")
    if meta.get("config") != config:
        raise Refused("stale: written with another config")


class PeerLink:
    """This process's end of the peer copies: the server for its host's directory, the sender."""

    def __init__(self, directory: str, process: int, processes: int, keep: int, host: str | None = None):
        self.directory, self.process, self.processes, self.keep = directory, process, processes, keep
        self.server = _Server(("0.0.0.0", 0), _Handler)
        self.server.link = self
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="peer-copy-server").start()
        # what the others need to know of this process: its host, and where its server listens
        self.record = json.dumps([host or host_name(), f"{_reachable_address()}:{self.server.server_address[1]}"])
        self._peers: list[tuple[str, str]] = []  # (host, address) by process

    # ------------------------------------------------------------------ who is where

    def join(self, records: list[str]) -> None:
        """Every process's `record`, in process order (exchanged by the caller)."""
        self._peers = [tuple(json.loads(r)) for r in records]

    def peers(self) -> list[tuple[str, str]]:
        return self._peers

    def holder(self) -> int | None:
        """The process that holds this one's copy: the next in ring order on another host."""
        hosts = [host for host, _ in self.peers()]
        for offset in range(1, self.processes):
            candidate = (self.process + offset) % self.processes
            if hosts[candidate] != hosts[self.process]:
                return candidate
        return None

    # ------------------------------------------------------------------ send, fetch

    def send(self, step: int, path: str) -> str | None:
        """Send this process's snapshot file of `step` to its holder; the holder's name, or None
        without one. Raises OSError when the transfer fails."""
        holder = self.holder()
        if holder is None:
            return None
        header = {"op": "put", "owner": self.process, "step": step, "size": os.path.getsize(path),
                  "sha256": sha256_file(path)}
        with _connect(self.peers()[holder][1]) as conn, open(path, "rb") as f:
            conn.sendall(json.dumps(header).encode() + b"\n")
            while block := f.read(1 << 20):
                conn.sendall(block)
            reply = conn.makefile("rb").readline()
        if json.loads(reply or b"{}").get("ok") is not True:
            raise OSError(f"process {holder} did not store it: {reply[:200]!r}")
        return f"process {holder} ({self.peers()[holder][0]})"

    def fetch(self, source: int, owner: int, step: int, target: str) -> None:
        """Copy `owner`'s snapshot of `step`, as held by process `source`, to `target` (written to
        `.tmp`, renamed only once whole and its checksum matches); Refused or OSError if not."""
        with _connect(self.peers()[source][1]) as conn:
            conn.sendall(json.dumps({"op": "get", "owner": owner, "step": step,
                                     "processes": self.processes}).encode() + b"\n")
            stream = conn.makefile("rb")
            header = json.loads(stream.readline() or b"{}")
            if "size" not in header:
                raise Refused(f"process {source} has no copy of step {step}: {header.get('error', 'no answer')}")
            arrived, digest = _receive(stream, header["size"], target + ".tmp")
        if arrived != header["size"]:
            os.remove(target + ".tmp")
            raise Refused(f"partial: {arrived} of {header['size']} bytes arrived")
        if digest != header["sha256"]:
            os.remove(target + ".tmp")
            raise Refused("its SHA-256 does not match the one recorded when it was sent")
        os.replace(target + ".tmp", target)

    # ------------------------------------------------------------------ the holder's side

    def store(self, header: dict, stream) -> None:
        """A peer's file arriving: written whole to `.tmp`, then renamed, with its checksum."""
        owner, step, size = int(header["owner"]), int(header["step"]), int(header["size"])
        path = os.path.join(self.directory, str(step), copy_name(owner, self.processes))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        arrived, digest = _receive(stream, size, path + ".tmp")
        if arrived != size or digest != header["sha256"]:
            os.remove(path + ".tmp")
            raise OSError(f"partial or damaged in transit ({arrived} of {size} bytes)")
        with open(path + ".sha256", "w") as f:
            f.write(header["sha256"])
        os.replace(path + ".tmp", path)
        self._prune(owner)

    def _prune(self, owner: int) -> None:
        """Keep the newest `keep` steps of `owner`'s copies."""
        steps = sorted(inventory(self.directory, self.processes).get(owner, []))
        for step in steps[:-self.keep]:
            for suffix in ("", ".sha256"):
                try:
                    os.remove(os.path.join(self.directory, str(step), copy_name(owner, self.processes)) + suffix)
                except FileNotFoundError:
                    pass

    def serve(self, header: dict, conn) -> None:
        """Send the file of `owner` at `step` this host holds (its own or a peer copy)."""
        step, owner, processes = int(header["step"]), int(header["owner"]), int(header["processes"])
        folder = os.path.join(self.directory, str(step))
        for name in (copy_name(owner, processes), f"process_{owner}-of-{processes}.npz"):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                continue
            # the checksum recorded when it arrived (a copy), else the file's own (an own file)
            recorded = path + ".sha256"
            if os.path.exists(recorded):
                with open(recorded) as f:
                    digest = f.read().strip()
            else:
                digest = sha256_file(path)
            conn.sendall(json.dumps({"size": os.path.getsize(path), "sha256": digest}).encode() + b"\n")
            with open(path, "rb") as f:  # streamed: a snapshot can be GBs
                while block := f.read(1 << 20):
                    conn.sendall(block)
            return
        conn.sendall(json.dumps({"error": f"no file of process {owner} at step {step}"}).encode() + b"\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    link: PeerLink


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(TIMEOUT_S)
        try:
            header = json.loads(self.rfile.readline() or b"{}")
            if header.get("op") == "put":
                self.server.link.store(header, self.rfile)
                self.wfile.write(b'{"ok": true}\n')
            elif header.get("op") == "get":
                self.server.link.serve(header, self.connection)
        except (OSError, ValueError, KeyError) as e:
            try:
                self.wfile.write(json.dumps({"error": str(e)[:300]}).encode() + b"\n")
            except OSError:
                pass


def _receive(stream, size: int, path: str) -> tuple[int, str]:
    """Up to `size` bytes of `stream` into `path`: (bytes that arrived, their SHA-256)."""
    digest, left = hashlib.sha256(), size
    with open(path, "wb") as f:
        while left > 0 and (block := stream.read(min(left, 1 << 20))):
            digest.update(block)
            f.write(block)
            left -= len(block)
    return size - left, digest.hexdigest()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)


def _reachable_address() -> str:
    """The address peers reach this host at: its hostname's, or loopback on a host without one."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
