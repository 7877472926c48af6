"""Which ranks a ``RankGroup`` calls: every rank when each must take part (a micro-step, a gather
of sharded weights, a move of its state), only the ranks that do something when the ranks' setup
says the others need not (the simulated backend: nothing to move, the whole state on every rank).
A switch of the emulated 16-rank trainer paid ~40 ms of round trips to ranks with nothing to do."""

from __future__ import annotations

import types

import pytest

import cluster.actors.trainer_rank as trainer_rank
from cluster.actors.trainer_rank import RankGroup, RankInfo


class Method:
    def __init__(self, fn):
        self.remote = fn


class FakeRank:
    """A rank actor whose calls answer at once (the "ref" is the value) and are written to ``log``."""

    def __init__(self, rank: int, log: list, *, hybrids=(), moves: bool, replicated: bool):
        self.rank, self.log = rank, log
        info = RankInfo(rank=rank, backend="gloo", device="cpu", gpu_ids=(), node="node", hybrids=tuple(sorted(hybrids)),
                        worker=None, pid=rank, moves=moves, replicated=replicated)
        self.address = Method(lambda: ("127.0.0.1", 1))
        self.setup = Method(lambda *args: info)
        for verb, answer in [("offload", {"offload_s": 0.1}), ("reload", {"reload_s": 0.1}),
                             ("hybrid_load", 0.01), ("send_weights", None),
                             ("weights", {"weight": rank}), ("rollout_shapes", [("weight", (16,))]),
                             ("save_checkpoint", "info")]:
            setattr(self, verb, Method(self._answer(verb, answer)))

    def _answer(self, verb, answer):
        def call(*args):
            self.log.append((verb, self.rank))
            return answer
        return call


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(trainer_rank, "ray", types.SimpleNamespace(
        get=lambda refs, timeout=None: refs,
        wait=lambda pending, num_returns, timeout: (pending[:num_returns], pending[num_returns:]),
    ))


def group(log: list, **kinds) -> RankGroup:
    hosts = {0: ["hybrid-0"], 2: ["hybrid-1"]}  # two hybrids of TP 2 on four ranks
    return RankGroup([FakeRank(r, log, hybrids=hosts.get(r, ()), **kinds) for r in range(4)])


def switch(ranks: RankGroup) -> None:
    """The rank-group calls of one lend and take-back of hybrid-1, one broadcast and one save."""
    ranks.offload()
    ranks.hybrid_load(["hybrid-1"], 3)
    ranks.reload()
    ranks.send_weights(None)
    ranks.state_dict_for_rollout()
    ranks.save_checkpoint("ckpt")


def test_a_group_of_simulated_ranks_calls_only_the_ranks_that_do_something(fake_ray):
    log: list = []
    switch(group(log, moves=False, replicated=True))
    assert log == [("hybrid_load", 2), ("send_weights", 0), ("weights", 0), ("save_checkpoint", 0)]


def test_a_group_of_sharded_ranks_that_move_their_state_calls_every_rank(fake_ray):
    log: list = []
    switch(group(log, moves=True, replicated=False))
    every = [0, 1, 2, 3]
    assert log == [*(("offload", r) for r in every), *(("hybrid_load", r) for r in every),
                   *(("reload", r) for r in every), *(("send_weights", r) for r in every),
                   *(("weights", r) for r in every), *(("save_checkpoint", r) for r in every)]


def test_the_trainer_moves_nothing_and_takes_no_lock_for_a_group_without_moves(fake_ray):
    import asyncio

    import cluster.actors.trainer as actors

    trainer_cls = actors.TrainerActor.__ray_metadata__.modified_class  # the plain class behind the actor
    log: list = []
    ranks = group(log, moves=False, replicated=True)
    trainer = trainer_cls(lambda: ranks, {}, namespace="unit", required_samples=4)

    async def moves():
        async with trainer._train_lock:  # a broadcast holds the lock: the moves must not wait for it
            return await asyncio.wait_for(asyncio.gather(trainer.offload(), trainer.reload()), timeout=5)

    assert asyncio.run(moves()) == [{}, {}]
    assert log == []
