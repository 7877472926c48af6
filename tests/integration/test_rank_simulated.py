"""A rank of the emulated trainer (simulated backend) loads the hybrid it hosts without paying for
what only a sharded backend needs: its tensors are plain, so the in-rank load never imports
``torch.distributed.tensor`` (~0.5 s a process, which every rank paid at once in the first lend,
an 8 s switch in the emulated 32-GPU run that taught ``predictive`` never to lend again)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from cluster.actors.trainer_rank import load_in_rank
    from cluster.backends import SimulatedBackend
    from cluster.engines.simulated import SimulatedEngine

    backend = SimulatedBackend(per_token_s=0.0, sleep=lambda s: None)
    engine = SimulatedEngine(start_asleep=True)

    async def lend():
        await engine.wake_up()
        await load_in_rank(backend, [engine], 3)

    asyncio.run(lend())
    print(engine.is_sleeping, engine.param_version, "torch.distributed.tensor" in sys.modules)
""")


def test_a_simulated_rank_loads_its_hybrid_without_importing_the_sharded_tensor_module():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "3", "False"]  # awake, at the version loaded, nothing imported
