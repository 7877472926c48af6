"""Rollout: the data plane between the rollout replicas and the trainer.

Owns the load balancer that routes requests to replicas and holds or drains them for a switch
(``rollout.load_balancer``), the message queue of finished samples (``rollout.message_queue``), the
rollouter that keeps the replicas fed and turns generations into scored samples
(``rollout.rollouter``) and the asyncio wake-ups they wait on (``rollout.wakeups``). Ray actors host
these objects (``cluster.actors.rollout_service``); they know nothing of Ray themselves.

May import ``config``, ``metrics``, ``loop`` and ``data`` only. Must not import Ray or torch.
"""
