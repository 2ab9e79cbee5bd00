"""The local tier's replicas over TCP (jaxtrain/checkpoint/replica_transfer.py), against a real
server on loopback: bytes round trip, the token, refusals reach the sender, an unreachable or
vanished peer, a sender cut off halfway; and the local tier's side of a put (every chunk's crc32
checked before the commit). The 3-process drill over private disks is in test_local_tier.py."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import mesh_of  # noqa: E402
from test_checkpoint import cfg, host_state, to_device  # noqa: E402

from jaxtrain.checkpoint import replica_transfer as rt  # noqa: E402
from jaxtrain.checkpoint.local_tier import LocalTier  # noqa: E402

TOKEN = "t" * 32


class Store:
    """The callbacks of a server: what was put, and what a get returns."""

    def __init__(self):
        self.held: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    def put(self, owner, step, manifest, data):
        if step < 0:
            raise ValueError("no negative steps")
        self.held[(owner, step)] = (manifest, bytes(data))

    def get(self, owner, step):
        return self.held[(owner, step)]


@pytest.fixture
def server():
    store = Store()
    s = rt.ReplicaServer(TOKEN, store.put, store.get, host="127.0.0.1", timeout_s=10)
    yield s, store, ("127.0.0.1", s.port)
    s.close()


def test_put_then_get_round_trips_the_bytes(server):
    s, store, addr = server
    rng = np.random.default_rng(0)
    buffers = [memoryview(rng.bytes(n)) for n in (0, 1, 5 << 20, 12345)]  # more than one receive chunk
    rt.put(addr, TOKEN, 3, 7, b'{"m": 1}', buffers, timeout_s=10)
    assert store.held[(3, 7)] == (b'{"m": 1}', b"".join(bytes(b) for b in buffers))
    manifest, data = rt.get(addr, TOKEN, 3, 7, timeout_s=10)
    assert manifest == b'{"m": 1}' and bytes(data) == b"".join(bytes(b) for b in buffers)


def test_a_wrong_token_is_refused_and_nothing_is_put(server):
    s, store, addr = server
    with pytest.raises(rt.TransferError, match="wrong token"):
        rt.put(addr, "x" * 32, 0, 1, b"{}", [memoryview(b"abc")], timeout_s=10)
    with pytest.raises(rt.TransferError, match="wrong token"):
        rt.get(addr, "x" * 32, 0, 1, timeout_s=10)
    assert store.held == {} and s.refused == 2


def test_the_holders_refusal_and_a_missing_step_reach_the_caller(server):
    s, store, addr = server
    with pytest.raises(rt.TransferError, match="refused step -1: ValueError: no negative steps"):
        rt.put(addr, TOKEN, 0, -1, b"{}", [memoryview(b"abc")], timeout_s=10)
    with pytest.raises(rt.TransferError, match="has no step 9 of process 0"):
        rt.get(addr, TOKEN, 0, 9, timeout_s=10)


def test_an_unreachable_peer_is_one_error(server):
    s, store, addr = server
    s.close()
    with pytest.raises(rt.TransferError, match="unreachable"):
        rt.put(addr, TOKEN, 0, 1, b"{}", [memoryview(b"abc")], timeout_s=5)


def test_a_sender_cut_off_halfway_commits_nothing(server):
    s, store, addr = server
    header = json.dumps({"token": TOKEN, "op": "put", "owner": 0, "step": 1, "manifest_bytes": 2,
                         "data_bytes": 1000}).encode()
    with socket.create_connection(addr) as sock:
        sock.sendall(struct.pack("!I", len(header)) + header + b"{}" + b"x" * 10)
    time.sleep(0.5)
    assert store.held == {}
    rt.put(addr, TOKEN, 0, 1, b"{}", [memoryview(b"y" * 1000)], timeout_s=10)  # the server still serves
    assert store.held[(0, 1)] == (b"{}", b"y" * 1000)


def test_the_tier_checks_every_chunk_of_a_replica_before_committing_it(tmp_path):
    """The receiving side of a put: a holder (here a one-process tier told it holds process 0's
    replicas) commits a good copy by rename, and refuses a copy with one flipped byte, a copy of
    another owner and a truncated one, writing nothing."""
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    local_cfg = cfg(local_every_steps=2, local_dir=str(tmp_path / "writer"))
    writer = LocalTier(local_cfg, str(tmp_path / "run"))
    writer.save(2, to_device(host_state(seed=2), mesh), {})
    writer.wait()
    copy = tmp_path / "writer" / "process-0" / "step-2"
    manifest, data = (copy / "manifest.json").read_bytes(), (copy / "shards.bin").read_bytes()
    holder = LocalTier(cfg(local_every_steps=2, local_dir=str(tmp_path / "holder")), str(tmp_path / "run"))
    holder.held_for = {0}
    held = tmp_path / "holder" / "process-0" / "peer-0"
    flipped = bytearray(data)
    flipped[len(flipped) // 3] ^= 0x10
    for bad, message in ((bytes(flipped), "checksum mismatch"), (data[:-4], "bytes arrived")):
        with pytest.raises(ValueError, match=message):
            holder._receive(0, 2, manifest, memoryview(bad))
        assert not held.exists()
    holder.held_for = {5}
    with pytest.raises(ValueError, match="not of 0"):
        holder._receive(0, 2, manifest, memoryview(data))
    holder.held_for = {0}
    holder._receive(0, 2, manifest, memoryview(data))
    assert sorted(os.listdir(held)) == ["step-2"]
    assert (held / "step-2" / "shards.bin").read_bytes() == data
    assert holder._send_back(0, 2) == (manifest, data)
