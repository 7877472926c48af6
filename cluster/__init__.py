"""Cluster: the long-lived workers of a Tidal run and what they wrap.

Owns the Ray actors of a run (``cluster.actors``, one module per actor) and the machinery inside
them: the rollout engines (``cluster.engines``), the train backends and the GRPO maths
(``cluster.backends``), the checkpoint file they write (``cluster.checkpoint_file``), weight sync
between them, placement on a Ray cluster, the local Ray cluster itself and the builders that make
all of it from a config. The data plane the actors host lives in ``rollout``, the models in
``models``, the data in ``data``, and the controller that lends hybrid replicas and takes them back
in ``loop``.

Must not import ``tasks``, ``flows``, ``storage`` or ``sim``; it may import ``config``,
``policies``, ``metrics``, ``loop``, ``data``, ``models`` and ``rollout`` only. Policy logic stays
in ``policies``: cluster code asks a policy and acts on the answer. Importing this package must not start Ray or load torch.
"""
