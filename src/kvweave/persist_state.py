"""The state tree of a saved cache (:mod:`kvweave.persist`, format version 2): what each layer and the cache
context hold, as plain JSON values whose tensors are named entries of the tensor file (:class:`_Encoder`), and
back into a freshly built cache (:class:`_Decoder`). :func:`state_schema` lists the saved fields per class.

Everything here is re-exported by :mod:`kvweave.persist`; import the names from there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvweave.persist_format import CacheFileError
from kvweave.state import STATEFUL, Stateful

_TRANSFORMERS_LAYERS = "transformers.cache_utils"


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
