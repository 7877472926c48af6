"""Cluster: the long-lived workers of a Tidal run and what they wrap.

Owns the Ray actors of the data plane and the objects inside them: the load balancer, the
message queue, the rollouter, the rollout replicas and their engines, the trainer and its train
backends, weight sync, and the dynamic resource controller that lends hybrid replicas to rollout
and takes them back.

Must not import ``tasks``, ``flows``, ``storage`` or ``sim``; it may import ``config``,
``policies`` and ``metrics`` only. Policy logic stays in ``policies``: cluster code asks a policy
and acts on the answer. Importing this package must not start Ray or load torch.
"""
