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

This module re-exports the ranks and head counts of :mod:`kvweave.tp` (which the cache and the model loader import:
it depends on nothing else of kvweave) and the launcher of :mod:`kvweave.launch`; it adds the reported bytes and
the cache files, which need :mod:`kvweave.persist`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvweave.launch import launch, needs_launch, torchrun_command
from kvweave.tp import (
    TensorParallel,
    TensorParallelError,
    check_head_counts,
    is_main_process,
    launched_world,
    load_kwargs,
    local_kv_heads,
    tensor_parallel,
)

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
    "load_kwargs",
    "local_kv_heads",
    "needs_launch",
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


# ------------------------------------------------------------------------------------------------ bytes


def summed_nbytes(cache: KVCache) -> int:
    """``cache.nbytes()`` summed over the ranks (the bytes of the whole sharded cache); one process: itself.
    A collective under tensor parallelism: every rank must call it."""
    held = cache.nbytes()
    return cache.tp.sum(held) if cache.tp is not None else held


def summed_full_kv_bytes(cache: KVCache, bits: int = 16) -> int:
    """``cache.full_kv_bytes(bits)`` summed over the ranks: what one process's ``DynamicCache`` would hold."""
    full = cache.full_kv_bytes(bits)
    return cache.tp.sum(full) if cache.tp is not None else full


# ------------------------------------------------------------------------------------------------ files


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
