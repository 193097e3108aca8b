"""Process entry points for transfer tests (module-level so spawned processes can import them)."""
from __future__ import annotations

import torch

from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer import BlockCopy, KVStorage

SPECS = [
    KVGroupSpec("attn", "full", 2, (2, 4, 2, 8), "float32", 4),
    KVGroupSpec("csa", "compressed", 1, (4, 16), "bfloat16", 4, compress_ratio=4),
]
NUM_BLOCKS = [12, 6]


def make_backend(name: str, engine_id: str, fill: float | None, **options):
    storage = KVStorage(name, engine_id, **options)
    caches = storage.allocate(SPECS, NUM_BLOCKS, torch.device("cpu"), [torch.float32, torch.bfloat16])
    if fill is not None:
        gen = torch.Generator().manual_seed(int(fill))
        for t in caches:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return storage.build(caches, SPECS)


def receiver(name: str, engine_id: str, to_parent, from_parent, options: dict | None = None) -> None:
    """Serve an endpoint; on each 'check' message, wait for the key and send back the blocks."""
    backend = make_backend(name, engine_id, None, **(options or {}))
    to_parent.put(backend.endpoint())
    while True:
        msg = from_parent.get()
        if msg[0] == "stop":
            break
        _, key, group, blocks = msg
        try:
            if key is not None:
                backend.wait_received(key, 20.0)
            to_parent.put(backend.kv_caches[group][blocks].clone())
        except Exception as exc:  # noqa: BLE001 - report to the test
            to_parent.put(repr(exc))
    backend.close()


def send(backend, endpoint, key: str, copies: list[BlockCopy], last: bool = True) -> int:
    return backend.send(endpoint, key, copies, last)
