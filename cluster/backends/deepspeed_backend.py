"""The DeepSpeed train backend: the torch backend's GRPO step on a DeepSpeed ZeRO engine (stage 0-3).

DeepSpeed is an optional extra (``pip install --no-build-isolation 'deepspeed>=0.16,<0.20'``);
importing this module works without it, constructing a backend raises ``ImportError``.

On CPU it must not JIT-compile any DeepSpeed op (a C++ build of ~30 s, and a compiler that may not
be there), so it:

- selects the CPU accelerator (``DS_ACCELERATOR=cpu``) before DeepSpeed is first imported;
- hands ``deepspeed.initialize`` a torch ``AdamW`` instance instead of an optimizer config (which
  would build ``cpu_adam``);
- marks the shared-memory comm op (``deepspeed_shm_comm``) incompatible before the process group
  starts (DeepSpeed otherwise builds it in ``init_distributed``);
- sets the single-process distributed env itself (``MASTER_ADDR``, a free ``MASTER_PORT``,
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) and starts a gloo group, unless one is already up.

Gradient accumulation over ``ppo_micro_batch_size_per_gpu`` sets the engine's accumulation
boundary by hand (``set_gradient_accumulation_boundary``) and steps once per mini-batch; the LR
(warmup) is written into the inner optimizer's param groups before that step.

Stage 0 clips gradients with torch (DeepSpeed's own stage-0 clip does not report the norm);
stages 1-3 use DeepSpeed's clipping and ``get_global_grad_norm``. Checkpoints use the shared
single-file format of ``cluster.backends.base`` (full weights + per-parameter AdamW state), so
they load into either backend with ``weights_only=True``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cluster.backends.torch_backend import _ADAM_KEYS, TorchBackend
from cluster.checkpoint_file import CheckpointError
from cluster.ports import free_port
from data.problems import Problem
from models.model import TinyLMConfig


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed. Does not import it: importing picks DeepSpeed's
    accelerator once per process, which ``import_deepspeed`` must do first."""
    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed with the CPU accelerator (when on CPU) and without the shm comm op build."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops as ds_ops

    # Probing every op's compatibility runs compiler subprocesses; the only reader is the comm
    # backend, and all we need it to know is "no shm comm op". An entry set here wins.
    compatible = ds_ops.__dict__.setdefault("__compatible_ops__", {})
    compatible["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


_started_group = False
"""Whether ``ensure_distributed`` started this process's default group (so it may tear it down)."""


def ensure_distributed(deepspeed: Any, device: torch.device) -> None:
    """Start a world-size-1 process group (gloo on CPU, nccl on CUDA) unless one exists."""
    global _started_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
        return
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=True)
    _started_group = True


def shutdown_distributed() -> bool:
    """Destroy the default process group if ``ensure_distributed`` started it, through DeepSpeed
    so that its cached group handles go too (a later backend can then start a fresh one).
    Call after every DeepSpeed backend in the process is closed. Returns whether it destroyed one."""
    global _started_group
    if not _started_group or not torch.distributed.is_initialized():
        _started_group = False
        return False
    import deepspeed.comm

    deepspeed.comm.destroy_process_group()
    _started_group = False
    return True


class DeepSpeedBackend(TorchBackend):
    """GRPO on TinyLM with a DeepSpeed engine (ZeRO ``zero_stage`` 0-3, fp32)."""

    name = "deepspeed"
    shards_with_fsdp = False  # ZeRO shards across the same ranks instead

    def __init__(
        self,
        model_cfg: TinyLMConfig | None,
        tokenizer: Any,
        problems: Sequence[Problem],
        *,
        zero_stage: int = 1,
        ds_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        self.zero_stage = zero_stage
        self._ds_overrides = dict(ds_config or {})
        super().__init__(model_cfg, tokenizer, problems, **kwargs)

    def close(self) -> None:
        """Finish the save in flight, release the engine (the process group stays: see
        ``shutdown_distributed``)."""
        super().close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
            self.engine = None

    # -- hooks ---------------------------------------------------------------------------------

    def _setup_optimizer(self) -> None:
        deepspeed = import_deepspeed(self.device)
        ensure_distributed(deepspeed, self.device)
        self._ds = deepspeed
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )
        ds_clip = 0.0 if self.zero_stage == 0 or self.grad_clip is None else self.grad_clip
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": ds_clip,
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        config.update(self._ds_overrides)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=config)

    def _forward_module(self) -> Any:
        return self.engine

    def _train_mode(self, on: bool) -> None:
        self.engine.train(on)

    def _backward(self, loss: torch.Tensor, *, last: bool) -> None:
        # Micro-batches accumulate into one update: the engine's boundary is set by hand (the
        # count varies per step, so ``gradient_accumulation_steps`` stays 1 and never rescales
        # the loss, which ``cluster.backends.grpo`` already normalises by the whole mini-batch).
        # the boundary is set before each backward; ``_step`` then calls ``engine.step()`` once
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def _step(self) -> float:
        norm: float | None = None
        if self.zero_stage == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf))
        self.engine.step()
        if norm is None:
            got = self.engine.get_global_grad_norm()
            norm = float(got) if got is not None else float("nan")
        return norm

    def _param_groups(self) -> list[dict[str, Any]]:
        return self._inner_optimizer().param_groups

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.engine.module.named_parameters())

    def _param_shape(self, name: str) -> torch.Size:
        p = self._params().get(name)
        if p is None:  # a tied weight (an HF lm_head sharing the embedding) is in the state dict only
            return self._export_weights()[name].shape
        return p.ds_shape if hasattr(p, "ds_shape") else p.shape

    def _export_weights(self) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:
            params = list(self.engine.module.parameters())
            with self._ds.zero.GatheredParameters(params, modifier_rank=None):
                out = {n: p.detach().to("cpu", copy=True) for n, p in self.engine.module.named_parameters()}
            out.update({alias: out[name] for alias, name in self._tied.items()})  # as the state dict lists them
            return out
        return dict(self.engine.module.state_dict())

    def _import_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        params = self._params()
        weights = {name: value for name, value in weights.items() if name not in self._tied}  # set through their source
        if self.zero_stage == 3:
            # The module's (partitioned) params and the fp32 master partitions are separate:
            # write the gathered params (re-partitioned on exit), then the masters.
            with self._ds.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                with torch.no_grad():
                    for name, value in weights.items():
                        params[name].data.copy_(value.to(params[name].device, params[name].dtype))
            for name, value in weights.items():
                safe_set_full_fp32_param(params[name], value.to(self.device, torch.float32))
            return
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
        if self.zero_stage > 0:  # the fp32 master copy lives apart from the module's params
            for name, value in weights.items():
                safe_set_full_fp32_param(params[name], value.to(self.device, torch.float32))

    def _move(self, device: torch.device | str, *, offload: bool) -> dict[str, float]:
        """ZeRO 1-3 keep their optimizer state, fp32 master weights and gradients in buffers of
        their own: DeepSpeed's ``offload_states`` / ``reload_states`` move them (the parameters too
        with ``param_offload``); stage 0 is a plain torch optimizer (the torch backend's moves)."""
        if self.zero_stage == 0 or self.device.type == "cpu" or offload == self._offloaded:
            return super()._move(device, offload=offload)
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        t0 = time.perf_counter()
        if offload:
            states = {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                      OffloadStateTypeEnum.contiguous_grad_buffer, OffloadStateTypeEnum.lp_grads}
            if self.param_offload:
                states.add(OffloadStateTypeEnum.lp_params)
            self.engine.offload_states(include=states, device=OffloadDeviceEnum.cpu, pin_memory=True)
        else:
            self.engine.reload_states()
        torch.cuda.synchronize(self.device)
        self._offloaded = offload
        if offload:
            torch.cuda.empty_cache()
        return {f"{'offload' if offload else 'reload'}_zero_states_s": time.perf_counter() - t0}

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer if self.zero_stage == 0 else self.optimizer.optimizer

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The fp32 flat partitions the inner AdamW steps (its state is keyed by them)."""
        if self.zero_stage == 3:  # stage 3 swaps them into param_groups only during step()
            return list(self.optimizer.fp32_partitioned_groups_flat)
        return [p for group in self._inner_optimizer().param_groups for p in group["params"]]

    def _export_optim_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.zero_stage == 0:
            return super()._export_optim_state()
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self._inner_optimizer()
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        if not steps:
            return {}
        step = torch.as_tensor(steps[0]).detach().to("cpu", torch.float32).clone()
        out = {}
        for name, p in self._params().items():
            entry = {"step": step.clone()}
            for key in _ADAM_KEYS:
                value = safe_get_full_optimizer_state(p, key)
                if value is None:
                    raise CheckpointError(f"DeepSpeed returned no {key} for {name}")
                entry[key] = value.detach().to("cpu", torch.float32).reshape(self._param_shape(name)).clone()
            out[name] = entry
        return out

    def _import_optim_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        if self.zero_stage == 0:
            super()._import_optim_state(state)
            return
        from deepspeed.utils import safe_set_full_optimizer_state

        inner = self._inner_optimizer()
        params = self._params()
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise CheckpointError(f"optimizer state for unknown parameters {unknown}")
        steps = {float(st["step"]) for st in state.values()}
        if len(steps) > 1:
            raise CheckpointError(f"ZeRO keeps one AdamW step count per group; checkpoint has {sorted(steps)}")
        step = steps.pop() if steps else 0.0
        # Keep existing state tensors (DeepSpeed links per-parameter views into them); AdamW
        # creates its state lazily at the first step, so create it when it is not there yet.
        # Step 0 with zero moments is exactly a fresh AdamW.
        for flat in self._flat_partitions():
            st = inner.state[flat]
            st["step"] = torch.tensor(step, dtype=torch.float32)
            for key in _ADAM_KEYS:
                if key in st:
                    st[key].zero_()
                else:
                    st[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO 1/2: point each parameter's fragment at the state just made
            link()
        for name, st in state.items():
            for key in _ADAM_KEYS:
                safe_set_full_optimizer_state(params[name], st[key].to(self.device, torch.float32), key)
