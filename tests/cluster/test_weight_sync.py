"""The collective weight transport (``cluster.weight_sync``): the bucket plan, the manifest check,
and real gloo groups between spawned processes: buckets arrive whole and in the wire dtype, a
member lost mid-sync fails the sender within the group's timeout instead of hanging, and the next
generation re-forms without it."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from cluster import weight_sync as ws
from cluster.ports import free_port

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(50, 16, generator=g), "layer.0.w": torch.randn(16, 16, generator=g),
            "layer.0.b": torch.randn(16, generator=g), "head": torch.randn(16, 50, generator=g)}


def test_plan_fills_buckets_in_order_and_gives_an_oversized_tensor_its_own():
    shapes = {"a": (10,), "b": (10,), "c": (100,), "d": (5,)}
    m = ws.plan(shapes, dtype="float32", bucket_bytes=80)
    assert [[e.name for e in b] for b in m.buckets] == [["a", "b"], ["c"], ["d"]]
    assert m.nbytes == 125 * 4
    assert ws.plan(shapes, dtype="bfloat16", bucket_bytes=80).nbytes == 125 * 2
    with pytest.raises(ValueError, match="bucket_bytes"):
        ws.plan(shapes, dtype="float32", bucket_bytes=0)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        ws.plan(shapes, dtype="int8", bucket_bytes=80)


def test_check_manifest_names_what_is_missing_extra_or_misshapen():
    m = ws.plan({"a": (2, 3), "b": (4,)}, dtype="float32", bucket_bytes=1 << 20)
    ws.check_manifest(m, {"a": (2, 3), "b": (4,)}, model="m")
    with pytest.raises(ValueError, match=r"missing \['c'\].*wrong shape \[\('a', \(2, 3\), \(3, 2\)\)\]"):
        ws.check_manifest(m, {"a": (3, 2), "b": (4,), "c": (1,)}, model="m")


def test_group_spec_rejects_a_group_without_receivers_and_unknown_backends():
    with pytest.raises(ValueError, match="world=1"):
        ws.GroupSpec("127.0.0.1", 1, 1, 0)
    with pytest.raises(ValueError, match="'mpi'"):
        ws.GroupSpec("127.0.0.1", 1, 2, 0, backend="mpi")


def _receiver(spec: ws.GroupSpec, rank: int, manifest: ws.Manifest, out: mp.Queue, die_after: int | None) -> None:
    import os

    receiver = ws.Receiver()
    group = receiver.join(spec, rank)
    got = {}
    try:
        for i, bucket in enumerate(ws.receive(group, manifest)):
            if die_after is not None and i == die_after:
                os._exit(1)  # a member lost mid-sync
            got.update({name: t.clone() for name, t in bucket})
        # plain lists: a tensor would travel as a shared-memory handle of a process about to exit
        out.put((rank, {k: v.to(torch.float32).tolist() for k, v in got.items()}, {k: str(v.dtype) for k, v in got.items()}))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}", {}))


def _sync(sender: ws.Sender, spec: ws.GroupSpec, manifest, state, die: dict[int, int]):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(spec, r, manifest, out, die.get(r)), daemon=True)
             for r in range(1, spec.world)]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    try:
        stats = ws.send(sender.join(spec), manifest, state.__getitem__)
        error = None
    except RuntimeError as exc:
        stats, error = None, exc
    sent_s = time.perf_counter() - t0
    for p in procs:
        p.join(spec.timeout_s + 30)
    results = {}
    while not out.empty():
        rank, got, dtypes = out.get()
        results[rank] = ({k: torch.tensor(v) for k, v in got.items()} if isinstance(got, dict) else got, dtypes)
    return stats, error, sent_s, results


def test_buckets_reach_every_receiver_in_the_wire_dtype_and_a_lost_member_fails_the_sync_then_a_new_generation_works():
    state = _state()
    manifest = ws.plan(ws.named_shapes(state), dtype="bfloat16", bucket_bytes=1024)
    assert len(manifest.buckets) >= 3
    sender = ws.Sender("127.0.0.1", free_port("127.0.0.1"))
    try:
        spec = ws.GroupSpec(sender.address, sender.port, 3, generation=1, timeout_s=10)
        stats, error, _, results = _sync(sender, spec, manifest, state, {})
        assert error is None and stats.nbytes == manifest.nbytes and stats.buckets == len(manifest.buckets)
        want = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()}
        for rank in (1, 2):
            got, dtypes = results[rank]
            assert set(dtypes.values()) == {"torch.bfloat16"}
            assert all(torch.equal(got[k], want[k]) for k in state)

        # generation 2: rank 2 dies after the first bucket; the sender fails, within the timeout
        lost = ws.GroupSpec(sender.address, sender.port, 3, generation=2, timeout_s=10)
        stats, error, sent_s, results = _sync(sender, lost, manifest, state, {2: 1})
        assert stats is None and error is not None
        assert sent_s < lost.timeout_s + 5

        # generation 3, without it: whole again
        new = _state(seed=1)
        again = ws.GroupSpec(sender.address, sender.port, 2, generation=3, timeout_s=10)
        stats, error, _, results = _sync(sender, again, manifest, new, {})
        assert error is None
        got, _ = results[1]
        assert all(torch.equal(got[k], new[k].to(torch.bfloat16).to(torch.float32)) for k in new)
    finally:
        sender.leave()


def test_in_rank_copy_casts_into_the_engines_own_tensors():
    state = _state()
    targets = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    written = ws.copy_into(targets, state.items())
    assert written == sum(t.numel() * 2 for t in targets.values())
    assert all(targets[k].data_ptr() == ptrs[k] for k in targets)  # in place
    assert all(torch.equal(targets[k], state[k].to(torch.bfloat16)) for k in state)
