"""Tensor parallelism: kvweave caches on a model sharded by transformers' ``tp_plan`` under ``torchrun``.

transformers shards attention by heads (``q/k/v_proj`` column-wise, ``o_proj`` row-wise, an all-reduce after
it), so on each of ``W`` ranks the attention modules see only that rank's heads: keys and values
``[B, H/W, T, D]``. A kvweave cache made on such a model (``kvweave.load_model(name, tp_plan="auto")`` or
transformers' own ``from_pretrained(path, tp_plan="auto")``, then ``make_cache``) holds that rank's KV heads
(``cache.num_kv_heads`` is the rank's count, ``cache.tp`` says which rank), and its layers never see the
others. How each kind of decision is kept in step across the ranks:

- **Per KV head** (every evicting baseline's selection, quant's per-channel scales, DK-Cache's retrieved far
  pages): each rank decides for its own heads exactly as one process decides for those heads.
- **Deterministic**, from token counts and positions only, identical on every rank by construction: budgets
  per row, DK-Cache's tier boundaries and Self-Extend groups, sinks, recent windows, when DepthWeave folds,
  its token kinds' counts. Random draws are keyed by the *global* head (Keyformer's counter-based noise uses
  ``cache.kv_head_offset``), so rank ``r`` draws what one process draws for those heads.
- **All-reduced**, statistics one process takes over all of a row's heads: DK-Cache's entropy gate
  (``retrieve=entropy``: mean entropy over the heads), DepthWeave's attention-output probe errors (so every rank
  chooses the same ranks and refreshes its basis at the same folds), its attention signal (SVD row weights and
  router buckets) and the router's novelty. Every rank reaches these calls in the same order: the code paths
  leading to them depend only on deterministic quantities.

The one difference that remains by design: DepthWeave factorizes the heads a rank holds, so each rank's
token-side bases span ``G·(H/W)·D`` columns instead of ``G·H·D``; byte budgets are per rank (its share of the
16-bit full cache), so the bytes summed over ranks meet the same ``compression`` to within a rank step.

Reported numbers: :func:`summed_nbytes` (and ``summed_full_kv_bytes``) add the ranks' bytes; a cache file is one
file set per rank plus ``tp.json`` recording the world size (:func:`save_cache`, :func:`load_cache`).
``kvweave generate --tp N`` and ``kvweave eval --tp N`` re-execute themselves under ``torchrun`` (:func:`launch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvweave.cache import KVCache
    from kvweave.persist import Manifest

__all__ = [
    "TP_MANIFEST",
    "TensorParallel",
    "TensorParallelError",
    "check_head_counts",
    "is_main_process",
    "launch",
    "launched_world",
    "load_cache",
    "local_kv_heads",
    "rank_folder",
    "save_cache",
    "saved_method",
    "summed_full_kv_bytes",
    "summed_nbytes",
    "tensor_parallel",
    "torchrun_command",
]

TP_MANIFEST = "tp.json"
"""The file of a tensor-parallel cache folder that records the world size (written last, by rank 0)."""
TP_FORMAT = "kvweave-tp-cache"


class TensorParallelError(ValueError):
    """A model, cache file or launch that does not fit the tensor-parallel layout; the message says how."""


# --------------------------------------------------------------------------------------- ranks and groups


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


# ------------------------------------------------------------------------------------------- head counts


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


def summed_nbytes(cache: KVCache) -> int:
    """``cache.nbytes()`` summed over the ranks (the bytes of the whole sharded cache); one process: itself.
    A collective under tensor parallelism: every rank must call it."""
    held = cache.nbytes()
    return cache.tp.sum(held) if cache.tp is not None else held


def summed_full_kv_bytes(cache: KVCache, bits: int = 16) -> int:
    """``cache.full_kv_bytes(bits)`` summed over the ranks: what one process's ``DynamicCache`` would hold."""
    full = cache.full_kv_bytes(bits)
    return cache.tp.sum(full) if cache.tp is not None else full


# ----------------------------------------------------------------------------------------------- files


def rank_folder(path: str | os.PathLike[str], rank: int, size: int) -> Path:
    """The folder of rank ``rank``'s files in the cache folder ``path``."""
    return Path(path) / f"rank-{rank}-of-{size}"


def save_cache(cache: KVCache, model: Any, path: str | os.PathLike[str], prompt_ids: Any = None) -> Path:
    """Save ``cache`` to the folder ``path``: :func:`kvweave.save_cache` in one process; under tensor
    parallelism one file set per rank (``rank-R-of-W/``, each a normal cache folder of that rank's heads) and
    ``tp.json`` with the world size, written by rank 0 once every rank has saved. Every rank must call it."""
    from kvweave.persist import save_cache as save_one

    tp = cache.tp
    if tp is None:
        return save_one(cache, model, path, prompt_ids=prompt_ids)
    folder = Path(path)
    manifest = folder / TP_MANIFEST
    if tp.rank == 0:
        manifest.unlink(missing_ok=True)  # a set being rewritten is incomplete until the new tp.json
    tp.barrier()
    save_one(cache, model, rank_folder(folder, tp.rank, tp.size), prompt_ids=prompt_ids)
    tp.barrier()
    if tp.rank == 0:
        record = {
            "format": TP_FORMAT,
            "world_size": tp.size,
            "ranks": [rank_folder(folder, r, tp.size).name for r in range(tp.size)],
            "method": cache.method.spec(),
            "kv_heads": {"total": cache.config.num_key_value_heads, "per_rank": cache.num_kv_heads},
        }
        temporary = folder / (TP_MANIFEST + ".tmp")
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(temporary, manifest)
    tp.barrier()
    return folder


def read_tp_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``tp.json`` of a cache folder, ``None`` when the folder was saved by one process."""
    file = Path(path) / TP_MANIFEST
    if not file.is_file():
        return None
    from kvweave.persist import CacheFileError

    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CacheFileError(f"{file}: unreadable ({err}); save the cache again") from err
    if not isinstance(record, dict) or record.get("format") != TP_FORMAT or "world_size" not in record:
        raise CacheFileError(f"{file}: not a kvweave tensor-parallel cache manifest; save the cache again")
    return record


def saved_method(path: str | os.PathLike[str]) -> str:
    """The method spec of the cache saved at ``path`` (one process's or a tensor-parallel set)."""
    from kvweave.persist import read_manifest

    record = read_tp_manifest(path)
    return str(record["method"]) if record is not None else str(read_manifest(path)["method"])


def load_cache(path: str | os.PathLike[str], model: Any) -> tuple[KVCache, Manifest]:
    """Load a cache saved by :func:`save_cache` into ``model``: this rank's file set under tensor parallelism,
    :func:`kvweave.load_cache` in one process. A set saved by another world size is refused: each rank's files
    hold that rank's KV heads, so they fit only the layout they were saved from."""
    from kvweave.persist import CacheFileError
    from kvweave.persist import load_cache as load_one

    tp = tensor_parallel(model)
    world = tp.size if tp is not None else 1
    record = read_tp_manifest(path)
    saved = int(record["world_size"]) if record is not None else 1
    if saved != world:
        here = (
            f"this model is sharded over {world} ranks"
            if tp is not None
            else "this process holds the model whole (world size 1)"
        )
        how = (
            f"load it with {saved} ranks (torchrun --nproc-per-node {saved}, or `kvweave generate --tp {saved}`)"
            if saved > 1
            else "load it in one process (without torchrun or --tp)"
        )
        raise CacheFileError(
            f"{path}: the cache was saved by {saved} tensor-parallel rank{'s' if saved > 1 else ''} and "
            f"{here}; each rank's files hold only its own KV heads, so {how}, or prefill again"
        )
    if tp is None:
        return load_one(path, model)
    folder = rank_folder(path, tp.rank, tp.size)
    if not folder.is_dir():
        raise CacheFileError(
            f"{path}: rank {tp.rank}'s files ({folder.name}) are missing; save the cache again"
        )
    return load_one(folder, model)


# --------------------------------------------------------------------------------------------- launcher


def torchrun_command(argv: list[str], ranks: int) -> list[str]:
    """The command that runs ``kvweave ARGV`` on ``ranks`` local processes (one machine, a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "kvweave.cli",
        *argv,
    ]


def launch(argv: list[str], ranks: int, model: str | None = None) -> int:
    """Run ``kvweave ARGV`` under ``torchrun`` with ``ranks`` processes and return its exit status.

    ``model`` (a registry name or folder), when given, is checked first: head counts that do not divide by
    ``ranks`` are refused here, once, instead of by every rank. Each rank gets ``OMP_NUM_THREADS = cpus / ranks``
    unless it is set (torchrun would give every rank one thread)."""
    if model is not None:
        from transformers import AutoConfig

        from kvweave._compat import text_config
        from kvweave.models import resolve

        check_head_counts(text_config(AutoConfig.from_pretrained(resolve(model))), ranks)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    print(
        f"kvweave: launching {ranks} tensor-parallel ranks: {shlex.join(torchrun_command(argv, ranks))}",
        file=sys.stderr,
    )
    return subprocess.run(torchrun_command(argv, ranks), env=env, check=False).returncode


def needs_launch(ranks: int) -> bool:
    """Whether a command given ``--tp ranks`` must first start its ranks (it is not running under torchrun);
    :class:`TensorParallelError` when it runs under a torchrun of another size."""
    if ranks < 1:
        raise TensorParallelError(f"--tp must be at least 1, got {ranks}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in os.environ:
        return ranks > 1
    if world != ranks:
        raise TensorParallelError(
            f"--tp {ranks} runs under a torchrun of {world} processes; give --tp {world} or launch "
            f"{ranks} processes (or drop torchrun: `kvweave ... --tp {ranks}` starts them itself)"
        )
    return False


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
