"""Every KV transfer backend moves the right blocks into the right places between two processes
(local: within one), completes with the receiver's notification, renegotiates with a restarted
receiver, and reports failures as KVTransferError."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import pytest
import torch

from cluster.common.errors import KVTransferError
from cluster.kv_transfer import BlockCopy, resolve_backend_name
from tests.kv_transfer.workers import make_backend, receiver

CTX = mp.get_context("spawn")


class Receiver:
    def __init__(self, name: str, engine_id: str, **options) -> None:
        self.to_child, self.from_child = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=receiver, args=(name, engine_id, self.from_child, self.to_child, options),
                                daemon=True)
        self.proc.start()
        self.endpoint = self.from_child.get(timeout=60)

    def blocks(self, key: str | None, group: int, blocks: list[int]) -> torch.Tensor:
        """The receiver's blocks, after waiting for ``key``'s last write (None: no wait)."""
        self.to_child.put(("check", key, group, blocks))
        got = self.from_child.get(timeout=60)
        if isinstance(got, str):
            raise AssertionError(got)
        return got

    def stop(self) -> None:
        self.to_child.put(("stop",))
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def copies() -> list[BlockCopy]:
    return [BlockCopy(0, [3, 1, 7], [5, 0 + 2, 11]), BlockCopy(1, [2], [4])]


@pytest.mark.parametrize("name", ["ipc", "nccl", "nixl"])
def test_blocks_land_where_asked(name):
    rid = f"d-{uuid.uuid4().hex[:8]}"
    recv = Receiver(name, rid)
    sender = make_backend(name, f"p-{uuid.uuid4().hex[:8]}", fill=7)
    try:
        moved = sender.send(recv.endpoint, "req-1", copies()[:1], last=False)
        moved += sender.send(recv.endpoint, "req-1", copies()[1:], last=True)
        assert moved == 3 * sender.layout.groups[0].block_bytes + sender.layout.groups[1].block_bytes
        got = recv.blocks("req-1", 0, [5, 2, 11])
        assert torch.equal(got, sender.kv_caches[0][[3, 1, 7]])
        got = recv.blocks(None, 1, [4])
        assert torch.equal(got, sender.kv_caches[1][[2]])
        assert recv.blocks(None, 0, [0, 1]).abs().sum() == 0  # blocks nobody wrote
        assert sender.stats.count == 2 and sender.stats.bytes_total == moved
    finally:
        sender.close()
        recv.stop()


@pytest.mark.parametrize("name", ["ipc", "nccl", "nixl"])
def test_restarted_receiver_is_renegotiated(name):
    rid = f"d-{uuid.uuid4().hex[:8]}"
    sender = make_backend(name, f"p-{uuid.uuid4().hex[:8]}", fill=3)
    first = Receiver(name, rid)
    try:
        sender.send(first.endpoint, "a", copies(), last=True)
        first.blocks("a", 0, [5])
    finally:
        first.stop()
    second = Receiver(name, rid)  # same engine id, new generation and memory
    try:
        assert second.endpoint.generation != first.endpoint.generation
        sender.send(second.endpoint, "b", copies(), last=True)
        assert torch.equal(second.blocks("b", 0, [5, 2, 11]), sender.kv_caches[0][[3, 1, 7]])
    finally:
        sender.close()
        second.stop()


def test_nccl_pair_outlives_an_idle_pause_longer_than_its_timeout():
    """The receiver posts receives only for announced messages: an idle pair waits on nothing
    (with NCCL, a posted receive waiting timeout_s makes the watchdog abort the receiver's process;
    with Gloo it ends the pair). A send after a pause longer than the timeout still lands."""
    rid = f"d-{uuid.uuid4().hex[:8]}"
    recv = Receiver("nccl", rid, timeout_s=1.0)
    sender = make_backend("nccl", f"p-{uuid.uuid4().hex[:8]}", fill=5, timeout_s=1.0)
    try:
        sender.send(recv.endpoint, "before", copies(), last=True)
        assert torch.equal(recv.blocks("before", 0, [5, 2, 11]), sender.kv_caches[0][[3, 1, 7]])
        time.sleep(2.5)
        sender.send(recv.endpoint, "after", [BlockCopy(0, [9], [8])], last=True)
        assert torch.equal(recv.blocks("after", 0, [8]), sender.kv_caches[0][[9]])
    finally:
        sender.close()
        recv.stop()


def test_local_backend_and_injected_failure():
    a = make_backend("local", f"a-{uuid.uuid4().hex[:8]}", fill=1)
    b = make_backend("local", f"b-{uuid.uuid4().hex[:8]}", fill=None)
    a.send(b.endpoint(), "k", copies(), last=True)
    assert torch.equal(b.kv_caches[0][[5, 2, 11]], a.kv_caches[0][[3, 1, 7]])
    a.inject_failures = 1
    with pytest.raises(KVTransferError, match="injected"):
        a.send(b.endpoint(), "k2", copies(), last=True)
    assert a.stats.failures_total == 1
    stale = b.endpoint()
    b.close()
    with pytest.raises(KVTransferError):
        a.send(stale, "k3", copies(), last=True)


def test_layout_mismatch_is_refused():
    a = make_backend("local", f"a-{uuid.uuid4().hex[:8]}", fill=1)
    b = make_backend("local", f"b-{uuid.uuid4().hex[:8]}", fill=None)
    endpoint = b.endpoint()
    object.__setattr__(endpoint.layout.groups[0], "block_bytes", 1)
    with pytest.raises(KVTransferError, match="layouts differ"):
        a.send(endpoint, "k", copies(), last=True)


def test_auto_uses_ipc_on_one_node_and_nixl_across_nodes():
    """auto picks the path per pair from the receiver's node (simulated here by node ids)."""
    from tests.kv_transfer.workers import NUM_BLOCKS, SPECS
    from cluster.kv_transfer import KVStorage

    def auto(engine_id: str, node: str, fill: float | None, remote_peers: bool = False):
        storage = KVStorage("auto", engine_id, node, remote_peers=lambda: remote_peers)
        caches = storage.allocate(SPECS, NUM_BLOCKS, torch.device("cpu"), [torch.float32, torch.bfloat16])
        if fill is not None:
            for t in caches:
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(int(fill))).to(t.dtype))
        return storage.build(caches, SPECS)

    tag = uuid.uuid4().hex[:6]
    sender = auto(f"p-{tag}", "node-a", 5)
    near, far = auto(f"d1-{tag}", "node-a", None), auto(f"d2-{tag}", "node-b", None, remote_peers=True)
    try:
        # NIXL (whose UCX threads poll a core) only where a peer on another node exists
        assert sender.nixl is None and near.nixl is None and near.endpoint().info["nixl"] is None
        assert far.endpoint().info["nixl"] is not None and far.nixl is not None
        for receiver in (near, far):
            sender.send(receiver.endpoint(), f"k-{receiver.engine_id}", copies(), last=True)
            receiver.wait_received(f"k-{receiver.engine_id}", 10.0, sender_node="node-a")
            assert torch.equal(receiver.kv_caches[0][[5, 2, 11]], sender.kv_caches[0][[3, 1, 7]])
        assert sender.nixl is not None and sender.nixl.stats.count == 0  # inner stats: counted by auto
        assert len(sender.ipc._peers.values()) == 1  # only the same-node receiver was mapped
        assert sender.stats.count == 2
    finally:
        for b in (sender, near, far):
            b.close()
    assert resolve_backend_name("auto") == "auto"
    with pytest.raises(Exception, match="not one of"):
        resolve_backend_name("pigeon")


def test_segments_of_dead_processes_are_removed(tmp_path):
    """KV segments left by a process that died without unlinking them (SIGKILL, out of memory)
    are removed when the next engine on the host allocates; live processes' segments, other
    hosts' and other files stay."""
    import subprocess
    import sys

    from cluster.kv_transfer import ipc
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    host = ipc._host_tag()
    names = {"orphan": f"pdc-{host}-{dead_pid}-decode-x-g0", "live": f"pdc-{host}-{os.getpid()}-prefill-y-g0",
             "other_host": f"pdc-00000000-{dead_pid}-decode-z-g0", "unrelated": "something-else"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"kv")
    assert ipc.remove_orphaned_segments(str(tmp_path)) == [names["orphan"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "orphan")
    assert ipc.segment_prefix("decode-a").startswith(f"pdc-{host}-{os.getpid()}-")
