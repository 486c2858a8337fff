"""Where this process sits in a tensor-parallel model: its rank and process group, the KV heads it holds.

The layer that :mod:`kvweave.cache` and :mod:`kvweave.models` build on: it imports nothing else of kvweave, so
neither of them imports :mod:`kvweave.distributed` (which saves and loads tensor-parallel cache files through
:mod:`kvweave.persist`) or :mod:`kvweave.launch` (which starts the ranks). :mod:`kvweave.distributed` re-exports
every name here; see it for how the ranks keep their decisions in step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

__all__ = [
    "TensorParallel",
    "TensorParallelError",
    "check_head_counts",
    "is_main_process",
    "launched_world",
    "load_kwargs",
    "local_kv_heads",
    "tensor_parallel",
]


class TensorParallelError(ValueError):
    """A model, cache file or launch that does not fit the tensor-parallel layout; the message says how."""


# ------------------------------------------------------------------------------------- ranks and groups


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Where this process sits in a tensor-parallel model: ``rank`` of ``size``, and the process ``group``
    the model's own collectives use (kvweave's all-reduces go over it, never over the whole world)."""

    rank: int
    size: int
    group: Any

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` summed (``op="sum"``), averaged (``"mean"``) or maximised (``"max"``) over the ranks; a new
        tensor, the input is left alone."""
        import torch.distributed as dist

        out = tensor.detach().clone()
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(out, op=reduce_op, group=self.group)
        return out / self.size if op == "mean" else out

    def sum(self, value: int) -> int:
        """An integer summed over the ranks."""
        return int(self.all_reduce(torch.tensor([int(value)], dtype=torch.int64)).item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


def tensor_parallel(model: Any) -> TensorParallel | None:
    """The tensor-parallel layout of ``model`` (``None`` for a model held whole by one process).

    Read from the model's key projections: transformers' plans make them ``DTensor`` parameters sharded over a
    one-dimensional device mesh, which gives the rank, the size and the process group. Other sharded layouts
    (no ``k_proj``, a mesh of several dimensions) are refused rather than cached with the wrong head count."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support holds no sharded model
        return None
    sharded = None
    for name, parameter in model.named_parameters():
        if not isinstance(parameter, DTensor):
            continue
        sharded = sharded or name
        if name.endswith("k_proj.weight"):
            mesh = parameter.device_mesh
            if mesh.ndim != 1:
                raise TensorParallelError(
                    f"{name} is sharded over a {mesh.ndim}-dimensional device mesh; kvweave supports tensor "
                    "parallelism alone (tp_plan, a one-dimensional mesh)"
                )
            if mesh.size() == 1:
                return None
            return TensorParallel(rank=mesh.get_local_rank(), size=mesh.size(), group=mesh.get_group())
    if sharded is not None:
        raise TensorParallelError(
            f"the model is sharded ({sharded} is a DTensor) but has no sharded k_proj, from which kvweave reads "
            "each rank's KV heads; kvweave supports transformers' tensor-parallel plans of attention by heads"
        )
    return None


def launched_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process: the initialised process group's, else what ``torchrun`` put in the
    environment (``RANK``, ``WORLD_SIZE``; known before transformers initialises the group), else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Whether this process prints progress and writes results (rank 0, or the only process)."""
    return launched_world()[0] == 0


# ------------------------------------------------------------------------------------------ head counts


def check_head_counts(config: Any, world_size: int) -> None:
    """Refuse a model whose attention or KV heads do not divide over ``world_size`` ranks (naming the counts)."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if world_size > 1 and (heads % world_size or kv_heads % world_size):
        divisors = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0]
        raise TensorParallelError(
            f"tensor parallelism over {world_size} ranks needs head counts divisible by {world_size}: this model "
            f"has {heads} attention heads and {kv_heads} KV heads, so each rank would hold "
            f"{heads / world_size:g} and {kv_heads / world_size:g}. Use a world size that divides both "
            f"({', '.join(map(str, divisors))}), or run it in one process"
        )


def local_kv_heads(config: Any, tp: TensorParallel | None) -> int:
    """KV heads this process's cache holds: all of them in one process, ``H / W`` on each of ``W`` ranks."""
    kv_heads = int(config.num_key_value_heads)
    if tp is None:
        return kv_heads
    check_head_counts(config, tp.size)
    return kv_heads // tp.size


# ------------------------------------------------------------------------------ loading a sharded model


def load_kwargs(tp_plan: str | None) -> dict[str, Any]:
    """``from_pretrained`` keywords that shard a model with ``tp_plan``: a ``DistributedConfig`` where transformers
    has one (5.24 warns that the plain keyword is deprecated), else the ``tp_plan`` keyword."""
    if tp_plan is None:
        return {}
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
