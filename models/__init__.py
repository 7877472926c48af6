"""Models: the language models a run trains and serves.

Owns the tiny torch LM (``models.model``; its shape, torch-free, in ``models.tiny_config``), the Hugging Face models and tokenizers built locally
from configs (``models.hf``) and the SmolLM2 conversion (``models.smollm2``). The engines in
``cluster.engines`` serve them, the backends in ``cluster.backends`` train them.

May import ``config`` and ``data`` only; must not start Ray. Importing the package loads nothing.
"""
