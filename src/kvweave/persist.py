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
import errno
import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvweave.state import STATEFUL, Stateful

FORMAT = "kvweave-cache"
FORMAT_VERSION = 2  # 2: explicit per-class state (kvweave.state.Stateful); 1: the attribute graph (refused)
MANIFEST = "manifest.json"
TENSORS = "kv.safetensors"
_TRANSFORMERS_LAYERS = "transformers.cache_utils"
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


class CacheFileError(ValueError):
    """A saved cache that cannot be loaded (missing, corrupt, another format, another model)."""


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


# ------------------------------------------------------------------------------------------- state tree


def _rebuilt_node(obj: Any) -> dict[str, Any] | None:
    """Objects made from the model, not state: saved as a reference that a fresh cache resolves."""
    from kvweave.ops.rope import RopeTable, Rotary

    if isinstance(obj, Rotary):
        return {"__rotary__": obj.layer_type}
    if isinstance(obj, RopeTable):
        return {"__rope_table__": obj.rotary.layer_type}
    return None


class _Encoder:
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_names: dict[tuple[int, str], str] = {}
        self.object_ids: dict[int, int] = {}
        self.layer_index = {id(layer): i for i, layer in enumerate(cache.layers)}
        self.keep: list[Any] = []  # keeps encoded objects alive so their ids stay unique

    def layer(self, index: int) -> Any:
        """A top-level layer: its explicit state (kvweave's layers) or its attributes (transformers' own)."""
        layer = self.cache.layers[index]
        path = f"layers[{index}]"
        if isinstance(layer, Stateful):
            return self._object(layer, path)
        if type(layer).__module__.startswith(_TRANSFORMERS_LAYERS):
            return {
                "__layer__": type(layer).__qualname__,
                "state": {key: self.encode(value, f"{path}.{key}") for key, value in vars(layer).items()},
            }
        raise TypeError(
            f"kvweave.save_cache: layer {index} is a {type(layer).__module__}.{type(layer).__qualname__}, "
            "which kvweave cannot save"
        )

    def encode(self, obj: Any, path: str) -> Any:
        from kvweave.cache import CacheContext, KVCache
        from kvweave.registry import Method

        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, list):
            return [self.encode(item, f"{path}[{i}]") for i, item in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(item, f"{path}[{i}]") for i, item in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            items = [self.encode(item, f"{path}.item") for item in obj]
            return {"__set__": items, "frozen": isinstance(obj, frozenset)}
        if isinstance(obj, dict):
            if all(isinstance(key, str) for key in obj):
                return {"__dict__": {key: self.encode(value, f"{path}.{key}") for key, value in obj.items()}}
            return {
                "__pairs__": [
                    [self.encode(key, f"{path}.key"), self.encode(value, f"{path}[{key!r}]")]
                    for key, value in obj.items()
                ]
            }
        if obj is self.cache or isinstance(obj, KVCache):
            return {"__cache__": True}
        if isinstance(obj, CacheContext):
            return {"__context__": True}
        if isinstance(obj, Method):
            return {"__method__": obj.spec()}
        if id(obj) in self.layer_index:
            return {"__layer_ref__": self.layer_index[id(obj)]}
        rebuilt = _rebuilt_node(obj)
        if rebuilt is not None:
            return rebuilt
        if isinstance(obj, Stateful):
            return self._object(obj, path)
        raise TypeError(
            f"kvweave.save_cache: cannot save a {type(obj).__module__}.{type(obj).__qualname__} "
            f"(at {path}); only tensors, plain values and kvweave's Stateful objects are saved"
        )

    def _object(self, obj: Stateful, path: str) -> dict[str, Any]:
        known = self.object_ids.get(id(obj))
        if known is not None:
            return {"__ref__": known}
        self.object_ids[id(obj)] = len(self.object_ids)
        self.keep.append(obj)
        state = {key: self.encode(value, f"{path}.{key}") for key, value in obj.get_state().items()}
        return {"__object__": type(obj).state_name, "id": self.object_ids[id(obj)], "state": state}

    def _tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        """A tensor as a view of a saved storage: each storage is saved once, whole (bytes), so tensors that share
        one (views, slack capacity of growing buffers) share it again after loading, and bytes held match."""
        node: dict[str, Any] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "size": list(tensor.shape),
            "device": str(tensor.device),
        }
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return {"__tensor__": None, **node}
        key = (storage.data_ptr(), str(tensor.device))
        name = self.tensor_names.get(key)
        if name is None:
            name = f"s{len(self.tensors)}"
            self.tensor_names[key] = name
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self.tensors[name] = whole.detach().to("cpu").clone()
            self.keep.append(tensor)
        return {
            "__tensor__": name,
            "offset": tensor.storage_offset(),
            "stride": list(tensor.stride()),
            **node,
        }


class _Decoder:
    """Reads a state tree back into a freshly built cache: its layers and context receive their saved state."""

    def __init__(self, tensors: dict[str, torch.Tensor], cache: Any, device: torch.device) -> None:
        self.tensors, self.cache, self.device = tensors, cache, device
        self.objects: dict[int, Any] = {}
        self.storages: dict[tuple[str, str], torch.Tensor] = {}

    def layer(self, index: int, node: Any) -> None:
        """Restore layer ``index`` of the fresh cache from its saved node."""
        target = self.cache.layers[index]
        if isinstance(node, dict) and "__object__" in node:
            if not isinstance(target, Stateful) or node["__object__"] != type(target).state_name:
                raise CacheFileError(
                    f"layer {index} was saved as {node['__object__']}, the method now builds "
                    f"{type(target).__name__}; save the cache again"
                )
            self._restore(target, node)
        elif isinstance(node, dict) and "__layer__" in node:
            if node["__layer__"] != type(target).__qualname__:
                raise CacheFileError(
                    f"layer {index} was saved as {node['__layer__']}, the method now builds "
                    f"{type(target).__name__}; save the cache again"
                )
            for key, value in node["state"].items():
                setattr(target, key, self.decode(value))
        else:
            raise CacheFileError(f"layer {index}: unreadable saved entry {str(node)[:80]}")

    def _restore(self, target: Stateful, node: dict[str, Any]) -> Stateful:
        self.objects[node["id"]] = target
        state = {key: self.decode(value) for key, value in node["state"].items()}
        try:
            target.set_state(state)
        except ValueError as err:
            raise CacheFileError(f"{err}; save the cache again with this kvweave") from err
        return target

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(item) for item in node]
        if not isinstance(node, dict) or len(node) == 0:
            raise CacheFileError(f"saved cache state holds an unreadable entry: {node!r:.80}")
        if "__tensor__" in node:
            return self._tensor(node)
        if "__float__" in node:
            return float(node["__float__"])
        if "__device__" in node:
            saved = torch.device(node["__device__"])
            return saved if saved.type == "cpu" else self.device
        if "__dtype__" in node:
            dtype = getattr(torch, str(node["__dtype__"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CacheFileError(f"saved cache names an unknown dtype {node['__dtype__']!r}")
            return dtype
        if "__tuple__" in node:
            return tuple(self.decode(item) for item in node["__tuple__"])
        if "__dict__" in node:
            return {key: self.decode(value) for key, value in node["__dict__"].items()}
        if "__set__" in node:
            items = {self.decode(item) for item in node["__set__"]}
            return frozenset(items) if node.get("frozen") else items
        if "__pairs__" in node:
            return {self.decode(key): self.decode(value) for key, value in node["__pairs__"]}
        if "__cache__" in node:
            return self.cache
        if "__context__" in node:
            return self.cache.context
        if "__method__" in node:
            return self.cache.method
        if "__layer_ref__" in node:
            return self.cache.layers[int(node["__layer_ref__"])]
        if "__rotary__" in node:
            return self._rotary(node["__rotary__"])
        if "__rope_table__" in node:
            return self._rope_table(node["__rope_table__"])
        if "__ref__" in node:
            if node["__ref__"] not in self.objects:
                raise CacheFileError("saved cache state refers to an object before defining it")
            return self.objects[node["__ref__"]]
        if "__object__" in node:
            cls = STATEFUL.get(str(node["__object__"]))
            if cls is None:
                raise CacheFileError(
                    f"saved cache holds a {node['__object__']!r}, which this kvweave does not have; "
                    "load it with the kvweave version that saved it, or prefill again"
                )
            return self._restore(object.__new__(cls), node)
        raise CacheFileError(f"saved cache state holds an unknown entry: {sorted(node)}")

    def _rotary(self, layer_type: str | None) -> Any:
        rotary = self.cache.rotary.get(layer_type)
        if rotary is None:
            raise CacheFileError(
                f"the saved cache uses RoPE of layer type {layer_type!r}, which this model lacks"
            )
        return rotary

    def _rope_table(self, layer_type: str | None) -> Any:
        from kvweave.ops.rope import RopeTable

        tables = self.cache.context.rope_tables
        if layer_type not in tables:
            tables[layer_type] = RopeTable(self._rotary(layer_type))
        return tables[layer_type]

    def _tensor(self, node: dict[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, str(node.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise CacheFileError(f"saved cache names an unknown dtype {node.get('dtype')!r}")
        device = torch.device("cpu") if str(node.get("device", "cpu")) == "cpu" else self.device
        name = node["__tensor__"]
        if name is None:
            return torch.empty(node["size"], dtype=dtype, device=device)
        key = (name, str(device))
        whole = self.storages.get(key)
        if whole is None:
            saved = self.tensors.get(name)
            if saved is None:
                raise CacheFileError(
                    f"saved cache state names tensor {name!r}, which the tensor file lacks; the "
                    "folder is incomplete"
                )
            whole = self.storages[key] = saved.to(device)
        storage = whole.untyped_storage()
        size, stride, offset = node["size"], node["stride"], int(node["offset"])
        extent = (
            offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1 if all(size) else 0
        )
        if extent * dtype.itemsize > storage.nbytes():
            raise CacheFileError(
                f"saved tensor {name!r} is smaller than a view of it needs; the file is corrupt"
            )
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


def state_schema(manifest: dict[str, Any]) -> dict[str, list[str]]:
    """``{state_name: [saved fields]}`` of every object in a manifest's state tree: the cache file's schema
    (pinned by a test so that a refactor cannot change the format silently)."""
    schema: dict[str, list[str]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if "__object__" in node:
                schema[str(node["__object__"])] = sorted(node["state"])
            elif "__layer__" in node:
                schema["transformers." + str(node["__layer__"])] = sorted(node["state"])
            for value in node.values():
                walk(value)

    walk(manifest["state"])
    return dict(sorted(schema.items()))


# ----------------------------------------------------------------------------------------------- save


PENDING = MANIFEST + ".pending"
"""The new manifest while a save swaps the pair: complete on disk before the tensor file is replaced, renamed to
``manifest.json`` right after. A loader that finds the tensor file newer than ``manifest.json`` reads this one."""
_TEMPORARY = ".tmp"  # suffix of the files a save writes before renaming them (leftovers of a killed save)


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


def with_checksum(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its ``manifest_sha256`` (of every other field) set: what :func:`save_cache` writes.
    A manifest edited by hand is refused on loading unless it is sealed again with this function."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return {**body, "manifest_sha256": _manifest_digest(body)}


def _manifest_digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _write_temporary(folder: Path, data: bytes) -> Path:
    """``data`` in a new temporary file of ``folder``, flushed to the disk; removed again if writing fails."""
    handle, name = tempfile.mkstemp(dir=folder, prefix=".save-", suffix=_TEMPORARY)
    partial = Path(name)
    try:
        view = memoryview(data)
        while view:
            written = os.write(handle, view[: 1 << 24])
            view = view[written:]
        os.fsync(handle)
    except BaseException:
        os.close(handle)
        partial.unlink(missing_ok=True)
        raise
    os.close(handle)
    return partial


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entries (the renames) to the disk, where the platform allows it."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _finish_interrupted_save(folder: Path) -> None:
    """Before a new save: complete a save killed between its two renames (its pending manifest matches the
    tensor file) or drop its pending manifest, and remove temporary files that killed saves left."""
    pending = folder / PENDING
    if pending.is_file():
        try:
            manifest = _parse_manifest(pending, pending.read_bytes())
            current = _sha256(folder / TENSORS) if (folder / TENSORS).is_file() else None
        except (CacheFileError, OSError):
            manifest, current = None, None
        if manifest is not None and manifest["tensors"].get("sha256") == current:
            os.replace(pending, folder / MANIFEST)
        else:
            pending.unlink(missing_ok=True)
    for leftover in folder.glob(f".save-*{_TEMPORARY}"):
        leftover.unlink(missing_ok=True)


def _reason(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return "no space left on the device"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return err.strerror or str(err)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------- load


def _not_a_cache_folder(folder: Path) -> CacheFileError:
    if folder.is_file():
        inside = folder.name in (MANIFEST, TENSORS, PENDING)
        hint = f"give its folder {folder.parent}" if inside else "give the folder a save wrote"
        return CacheFileError(
            f"{folder} is a file, not a saved-cache folder (kv.safetensors + manifest.json): {hint}"
        )
    return CacheFileError(
        f"{folder}: no such folder; save a cache there first (kvweave.save_cache or "
        "`kvweave generate --save-cache`)"
    )


def _parse_manifest(file: Path, text: bytes) -> dict[str, Any]:
    """A manifest's contents, checked for format, version, the fields a loader needs and its own checksum."""
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheFileError(
            f"{file}: unreadable ({err}); the saved cache is corrupt: save it again"
        ) from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheFileError(f"{file}: not a kvweave cache manifest")
    version = manifest.get("format_version")
    if version == 1:
        raise CacheFileError(
            f"{file}: cache format version 1 (kvweave before its explicit saved state) cannot be "
            f"read by this kvweave (version {FORMAT_VERSION}); regenerate it: prefill the prompt "
            "again and save it (kvweave.save_cache, or `kvweave generate --save-cache DIR`)"
        )
    if version != FORMAT_VERSION:
        raise CacheFileError(
            f"{file}: cache format version {version}, this kvweave reads version "
            f"{FORMAT_VERSION}; save the cache again with this kvweave"
        )
    for key, kind in (("method", str), ("tokens", int), ("model", dict), ("tensors", dict), ("state", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CacheFileError(
                f"{file}: the manifest lacks {key!r} (or it is not a {kind.__name__}); the saved cache is "
                "corrupt: save it again"
            )
    state = manifest["state"]
    if not isinstance(state.get("layers"), list) or "context" not in state:
        raise CacheFileError(
            f"{file}: the manifest's state lacks its layers or context; save the cache again"
        )
    sealed = manifest.get("manifest_sha256")  # absent in files of kvweave 0.1.0 before the checksum
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    if sealed is not None and sealed != _manifest_digest(body):
        raise CacheFileError(
            f"{file}: the manifest's checksum does not match its contents, so it was edited or damaged after "
            "saving; save the cache again (a deliberate edit must be sealed with kvweave.persist.with_checksum)"
        )
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the saved cache at ``path`` (checked for format, version and its own checksum; not yet
    against the tensor file or the model: :func:`verify_cache` and :func:`load_cache` do that)."""
    folder = Path(path)
    file = folder / MANIFEST
    if not folder.is_dir():
        raise _not_a_cache_folder(folder)
    if not file.is_file() and (folder / "tp.json").is_file():
        raise CacheFileError(
            f"{folder}: saved by tensor-parallel ranks (tp.json), one file set per rank; load it with "
            "kvweave.distributed.load_cache on the same number of ranks (`kvweave generate --tp N --load-cache`)"
        )
    if not file.is_file():
        raise CacheFileError(
            f"{folder}: no {MANIFEST}; this is not a saved kvweave cache (or its save was "
            "interrupted): save it again"
        )
    try:
        text = file.read_bytes()
    except OSError as err:
        raise CacheFileError(f"{file}: unreadable ({_reason(err)}); save the cache again") from err
    return _parse_manifest(file, text)


def _read_pair(folder: Path, attempts: int = 4) -> tuple[dict[str, Any], bytes]:
    """The manifest and the bytes of the tensor file it names, read once and checked against each other.

    A tensor file newer than ``manifest.json`` is matched against the pending manifest of a save that was
    stopped between its renames (or is renaming now). A pair that does not match is read again while a writer
    is replacing it (the manifest changed, or a pending one is there) and then refused: what is returned always
    belongs together."""
    data: bytes | None = None
    name = TENSORS
    previous: dict[str, Any] | None = None
    for attempt in range(attempts):
        manifest = read_manifest(folder)
        if manifest == previous and not (folder / PENDING).exists():
            break  # nothing is being replaced: the mismatch is damage, reading again will not change it
        previous = manifest
        name = str(manifest["tensors"].get("file", TENSORS))
        if Path(name).name != name or name in ("", ".", ".."):
            raise CacheFileError(f"{folder}: the manifest names a tensor file outside its folder; save again")
        try:
            data = (folder / name).read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as err:
            raise CacheFileError(
                f"{folder / name}: unreadable ({_reason(err)}); save the cache again"
            ) from err
        if data is not None:
            digest = hashlib.sha256(data).hexdigest()
            if digest == manifest["tensors"].get("sha256"):
                return manifest, data
            try:
                pending = _parse_manifest(folder / PENDING, (folder / PENDING).read_bytes())
            except (OSError, CacheFileError):
                pending = None
            if pending is not None and digest == pending["tensors"].get("sha256"):
                return pending, data
        if attempt + 1 < attempts:
            time.sleep(0.01 * (attempt + 1))
    if data is None:
        raise CacheFileError(f"{folder}: the tensor file {name} is missing; save the cache again")
    raise CacheFileError(
        f"{folder / name}: checksum mismatch, the tensor file is corrupt or was changed after saving; "
        "save the cache again"
    )


def verify_cache(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check the saved cache at ``path`` without a model: the manifest (format, version, its checksum) and the
    tensor file's checksum. Returns the manifest; raises :class:`CacheFileError` with the reason. Cheap next
    to loading a model, so a command line checks a cache file with it first."""
    manifest, data = _read_pair(Path(path))
    _tensor_file(Path(path), data)
    return manifest


def _tensor_file(folder: Path, data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError) as err:
        raise CacheFileError(f"{folder}: unreadable tensor file ({err}); save the cache again") from err


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
