"""Cluster: the long-lived workers of a Tidal run and what they wrap.

Owns the Ray actors of a run (``cluster.actors``, one module per actor) and the objects inside
them: the load balancer, the message queue, the rollouter, the rollout replicas and their
engines, the trainer and its train backends, weight sync, the replica membership, and the
dynamic resource controller that lends hybrid replicas to rollout and takes them back.

Must not import ``tasks``, ``flows``, ``storage`` or ``sim``; it may import ``config``,
``policies``, ``metrics`` and ``loop`` only. Policy logic stays in ``policies``: cluster code asks a policy
and acts on the answer. Importing this package must not start Ray or load torch.
"""
