"""Save a compressed cache to disk and load it back, to reuse a long prefix without prefilling it again.

A saved cache is a folder of two files, and never a pickle:

- ``kv.safetensors``: every tensor the cache holds (any dtype, copied to the host);
- ``manifest.json``: the format and kvweave version, the method spec, a fingerprint of the model (its
  architecture numbers and a hash of its key-projection weights), the tokens cached, the prompt's token ids
  (when given), the SHA-256 of the tensor file, and the layers' state as a tree of plain JSON values whose
  tensors are named entries of the tensor file.

The state tree (format version 2) is explicit: each kvweave object writes exactly the fields its class lists
(:class:`kvweave.state.Stateful`) under its class's saved-state name, never its module path or its whole
attribute graph; values are numbers, strings, lists, tuples, dicts, devices, dtypes, tensors and other such
objects (transformers' own cache layers, e.g. sliding windows, save their attributes). Loading builds a fresh
cache for the same method and model and writes the saved state into its layers and its context; nested
objects are rebuilt from their saved fields. Objects shared between layers stay shared. What is built from
the model (its rotary embedding, RoPE tables) is not saved: the fresh cache provides it. Nor is a tokenizer
handed to ``cache.set_prompt`` (DepthWeave's router reads it): call ``cache.set_prompt(ids, tokenizer)`` on the
loaded cache to give it again. Version-1 files (the attribute graph) are refused with how to regenerate them.

Loading refuses, with the reason and the way out: a folder without a manifest, a manifest of another format
or version, a manifest whose own checksum (``manifest_sha256``, over every other field) does not match (edited
by hand or damaged), a tensor file whose checksum does not match (corrupt or edited), a model whose fingerprint
differs from the one the cache was made with, a method kvweave does not know. A save writes both files whole
before it swaps them (the new manifest waits as ``manifest.json.pending`` while the tensor file is replaced), and a
load reads the pair once and checks it: a killed save, a full disk or a concurrent writer leaves the previous
cache or the new one, never a mix (docs/reliability.md; ``verify_cache`` checks a folder without a model).

    cache = kvweave.make_cache("dkcache", model)
    model(prefix_ids, past_key_values=cache)            # prefill the long prefix once
    kvweave.save_cache(cache, model, "prefix.kv", prompt_ids=prefix_ids)
    ...
    cache, manifest = kvweave.load_cache("prefix.kv", model)
    model.generate(torch.cat([prefix_ids, question_ids], 1), past_key_values=cache)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from kvweave.persist_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PENDING,
    TENSORS,
    CacheFileError,
    _finish_interrupted_save,
    _read_pair,
    _reason,
    _sync_folder,
    _tensor_file,
    _write_temporary,
    read_manifest,
    verify_cache,
    with_checksum,
)
from kvweave.persist_state import _Decoder, _Encoder, state_schema

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PENDING",
    "TENSORS",
    "CacheFileError",
    "Manifest",
    "load_cache",
    "model_fingerprint",
    "read_manifest",
    "save_cache",
    "state_schema",
    "verify_cache",
    "with_checksum",
]

_FINGERPRINT_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclasses.dataclass
class Manifest:
    """What ``manifest.json`` says about a saved cache."""

    method: str
    tokens: int
    rows: int
    model: dict[str, Any]
    prompt_ids: list[list[int]] | None
    kvweave: str
    path: Path


# ------------------------------------------------------------------------------------------ fingerprint


def model_fingerprint(model: Any) -> dict[str, Any]:
    """Architecture numbers that decide the cache layout, the RoPE base, a hash of the key projections of the
    first and last layers (so another checkpoint of the same architecture is told apart) and the compute dtype."""
    from kvweave._compat import text_config

    config = text_config(model.config)
    found: dict[str, Any] = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    rope = getattr(config, "rope_theta", None)
    if rope is None:
        parameters = getattr(config, "rope_parameters", None) or {}
        rope = parameters.get("rope_theta") if isinstance(parameters, dict) else None
    found["rope_theta"] = float(rope) if rope is not None else None
    keys = [p for name, p in model.named_parameters() if name.endswith("k_proj.weight")]
    chosen = [keys[0], keys[-1]] if keys else list(model.parameters())[:1]
    digest = hashlib.sha256()
    for weight in chosen:
        # under tensor parallelism: this rank's shard (a rank's cache file fits that shard only)
        weight = weight.to_local() if hasattr(weight, "to_local") else weight
        digest.update(weight.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    found["weights_sha256"] = digest.hexdigest()[:16]
    found["dtype"] = (
        str(chosen[0].dtype).removeprefix("torch.") if chosen else None
    )  # the cache's dtype follows
    return found


# ------------------------------------------------------------------------------------------------- save


def save_cache(cache: Any, model: Any, path: str | os.PathLike[str], prompt_ids: Any = None) -> Path:
    """Write ``cache`` (a :class:`kvweave.KVCache` after a prefill) to the folder ``path``.

    ``prompt_ids`` (``[n]`` or ``[B, n]``), when given, are recorded so a loader can check that its prompt
    continues the cached one. Both files are written completely (and synced) under temporary names first; the
    new manifest is put beside the old one (``manifest.json.pending``) before the tensor file is replaced, and
    renamed over it right after. A save that is killed or runs out of disk at any point therefore leaves the
    previous cache or the new one loadable, never a mix, and a failed write raises :class:`CacheFileError` with
    the old cache intact. One writer at a time per folder; readers may load while it writes. Returns the folder.
    """
    from kvweave import __version__
    from kvweave.cache import KVCache

    if not isinstance(cache, KVCache):
        raise TypeError(
            f"kvweave.save_cache saves a kvweave.KVCache (from kvweave.make_cache), not a "
            f"{type(cache).__name__}"
        )
    tokens = max((layer.get_seq_length() for layer in cache.layers), default=0)
    if tokens == 0:
        raise ValueError("kvweave.save_cache: the cache is empty; run the prompt through the model first")
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise CacheFileError(
            f"{folder} is a file; a saved cache is a folder (kv.safetensors + manifest.json): give a new path "
            "or the folder of an earlier save"
        )
    encoder = _Encoder(cache)
    state = {
        "layers": [encoder.layer(i) for i in range(len(cache.layers))],
        "context": encoder.encode(cache.context.get_state(), "context"),  # the tokenizer is not saved
    }
    ids = None
    if prompt_ids is not None:
        ids = torch.as_tensor(prompt_ids).reshape(-1, torch.as_tensor(prompt_ids).shape[-1]).tolist()
    from safetensors.torch import save

    data = save(encoder.tensors, metadata={"format": FORMAT})
    count = len(encoder.tensors)
    encoder.tensors.clear()  # the serialized bytes replace the host copies
    manifest = with_checksum(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kvweave": __version__,
            "method": cache.method.spec(),
            "tokens": tokens,
            "rows": cache.batch_rows(),
            "model": model_fingerprint(model),
            "prompt_ids": ids,
            "tensors": {
                "file": TENSORS,
                "sha256": hashlib.sha256(data).hexdigest(),
                "count": count,
            },
            "state": state,
        }
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _finish_interrupted_save(folder)
        tensors = _write_temporary(folder, data)
        try:
            staged = _write_temporary(folder, json.dumps(manifest).encode())
            os.replace(staged, folder / PENDING)  # the new manifest is complete before the pair changes
            os.replace(tensors, folder / TENSORS)
        except BaseException:
            tensors.unlink(missing_ok=True)
            raise
        os.replace(folder / PENDING, folder / MANIFEST)
        _sync_folder(folder)
    except OSError as err:
        raise CacheFileError(
            f"{folder}: cannot write the cache ({_reason(err)}); the cache saved there before (if any) is "
            "kept: free space or fix the folder, then save again"
        ) from err
    return folder


# ------------------------------------------------------------------------------------------------- load


def load_cache(path: str | os.PathLike[str], model: Any) -> tuple[Any, Manifest]:
    """Load the cache saved at ``path`` for ``model``: ``(cache, manifest)``. The cache continues exactly where
    the saved one stopped (``model.generate`` with the cached prompt followed by new tokens)."""
    from kvweave.cache import make_cache

    folder = Path(path)
    manifest, data = _read_pair(folder)
    expected = manifest["model"]
    found = model_fingerprint(model)
    differ = [
        f"{key}: saved {expected.get(key)!r}, this model {found.get(key)!r}"
        for key in sorted(set(expected) | set(found))
        if expected.get(key) != found.get(key)
    ]
    if differ:
        raise CacheFileError(
            f"{folder}: the cache was saved from another model ({'; '.join(differ)}); load it "
            "with the model that made it, or prefill this model again"
        )
    tensors = _tensor_file(folder, data)
    del data
    try:
        cache = make_cache(manifest["method"], model)
    except ValueError as err:
        raise CacheFileError(f"{folder}: cannot rebuild method {manifest['method']!r}: {err}") from err
    device = next(model.parameters()).device
    decoder = _Decoder(tensors, cache, device)  # model-built parts come from the fresh cache
    layers = manifest["state"]["layers"]
    if len(layers) != len(cache.layers):
        raise CacheFileError(f"{folder}: {len(layers)} saved layers, the model has {len(cache.layers)}")
    try:
        for index, node in enumerate(layers):
            decoder.layer(index, node)
        cache.context.set_state(decoder.decode(manifest["state"]["context"]))
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CacheFileError):
            raise
        raise CacheFileError(
            f"{folder}: the saved state is malformed ({err!r}); save the cache again"
        ) from err
    info = Manifest(
        method=manifest["method"],
        tokens=int(manifest["tokens"]),
        rows=int(manifest.get("rows", 0)),
        model=expected,
        prompt_ids=manifest.get("prompt_ids"),
        kvweave=str(manifest.get("kvweave")),
        path=folder,
    )
    return cache, info
