"""Data: what a run trains on and how an answer is scored.

Owns the plain records that cross the actors (``data.types``: a request, a generation, a sample,
a micro-step's report), the tiny LM's arithmetic problems and tokenizer (``data.problems``), verl's
parquet datasets (``data.datasets``), the reward functions (``data.reward``) and the validation
pass (``data.validation``).

May import ``config`` and ``loop`` only (``loop`` for the typing of a switch report). Must not load
a model, start Ray or import the packages above it; importing it must not load torch.
"""
