"""The collective sync's sending end on a real 2-rank gloo group: rank 0 hosts the weight-sync
group and broadcasts while both ranks read the weights one tensor at a time. With FSDP2 each
parameter is gathered where it is read (no rank builds the whole model first); a ZeRO group has
no per-tensor view and sends the copy rank 0 gathered, and says so. Either way a receiver gets
exactly the trainer's weights after an update, in the wire dtype."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from dp_support import train_on_ranks
from test_data_parallel import make_deepspeed, make_torch
from test_torch_backend import make_samples

from cluster.backends import deepspeed_available

pytestmark = pytest.mark.slow


def _sync(backend, rank, *, dtype: str):
    from cluster import weight_sync as ws
    from cluster.actors.trainer_rank import rollout_shapes, send_from
    from cluster.ports import free_port

    manifest = ws.plan(rollout_shapes(backend), dtype=dtype, bucket_bytes=4096)
    if rank != 0:
        return send_from(backend, manifest)  # takes part in the gathers only
    sender = ws.Sender("127.0.0.1", free_port("127.0.0.1"), manifest=manifest)
    spec = ws.GroupSpec(sender.address, sender.port, 2, generation=1, timeout_s=60)
    got: dict[str, torch.Tensor] = {}

    def receive() -> None:  # a replica, here a thread of rank 0's process
        group = ws.Receiver().join(spec, 1)
        for bucket in ws.receive(group, manifest):
            got.update({name: t.clone() for name, t in bucket})

    thread = threading.Thread(target=receive)
    thread.start()
    report = send_from(backend, manifest, sender, spec)
    thread.join(60)
    sender.leave()
    return {"report": report, "got": got, "buckets": len(manifest.buckets)}


CASES = {"fsdp2-bf16": (make_torch, False, "bfloat16")}
if deepspeed_available():
    CASES["zero3-fp32"] = (functools.partial(make_deepspeed, zero_stage=3), True, "float32")


@pytest.mark.parametrize("case", CASES)
def test_rank_0_sends_the_groups_weights_bucket_by_bucket(case):
    make, gathered, dtype = CASES[case]
    ranks = train_on_ranks(2, make, make_samples(n=8)[:4], 1, then=functools.partial(_sync, dtype=dtype))
    sent, want = ranks[0]["extra"], ranks[0]["weights"]  # rank 0's whole weights after the update
    assert ranks[1]["extra"] is None
    assert sent["buckets"] > 1 and sent["report"].stats.buckets == sent["buckets"]
    assert sent["report"].gathered_whole_model is gathered
    assert sent["got"].keys() == want.keys()
    wire = getattr(torch, dtype)
    for name, value in want.items():
        assert sent["got"][name].dtype == wire
        assert torch.equal(sent["got"][name], value.to(wire)), name
