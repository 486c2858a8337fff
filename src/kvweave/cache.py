"""The cache framework: a method registry, ``KVCache`` (a ``transformers.Cache``) and the base cache layer.

Storage is not policy. ``KVCache`` is a list of per-layer objects, like transformers' ``DynamicCache``;
each compression method is a small options dataclass (:class:`Method`) registered with :func:`register`
whose ``make_layer`` builds the layer objects. Sliding-window layers (Gemma3's local layers) keep
transformers' own window layer: they are already bounded.

Bookkeeping every compressed layer shares (:class:`CompressedLayer`):
- ``seen``: tokens this layer has been given, i.e. the sequence position the model continues from
  (``get_seq_length``). Evicting methods hold fewer entries than that.
- ``slots: [B, H, T]``: for each held entry, the index of the token it came from. The attention mask
  transformers builds is indexed by token, so the columns of held entries are gathered from it: padding,
  causality and evictions stay right for any ``generate()`` call.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from kvweave._compat import Cache, CacheLayerMixin, default_layers, mask_to_bool, sdpa_attention, text_config
from kvweave.attention import mark_pending, prepare
from kvweave.ops.attention import masked_attention
from kvweave.ops.masking import visible_mask
from kvweave.ops.rope import Rotary, find_rotary

# ----------------------------------------------------------------------------------------------- registry

METHODS: dict[str, type[Method]] = {}


def register(name: str) -> Any:
    """Class decorator: register a :class:`Method` subclass under ``name``."""

    def wrap(cls: type[Method]) -> type[Method]:
        if name in METHODS:
            raise ValueError(
                f"method {name!r} is registered twice ({METHODS[name].__module__}, {cls.__module__})"
            )
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A method option: a dataclass field with a help text (shown by ``kvweave methods``)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class Method:
    """Base of every method: its options are dataclass fields, its capabilities class attributes."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = False  # logits equal to DynamicCache
    evicts: ClassVar[bool] = False  # holds fewer entries than tokens seen
    needs_positions: ClassVar[bool] = False  # de-rotates keys / changes RoPE positions
    cross_layer: ClassVar[bool] = False  # shares state between layers
    supports_batch: ClassVar[bool] = True
    uses_kvweave_attention: ClassVar[bool] = True  # needs kvweave.prepare(model)
    exact_prefill: ClassVar[bool] = True  # prefill attention is exact (compression happens after it)
    bounded_memory: ClassVar[bool] = False  # entries held stay bounded however long decoding runs
    compresses: ClassVar[bool] = True  # holds fewer bytes than the exact cache (False: exact or position-only)
    # For the contract test: options that make the method compress a ~40-token prompt, and option sets
    # that must be rejected (each with the name of the offending option).
    test_options: ClassVar[dict[str, Any]] = {}
    invalid_options: ClassVar[tuple[tuple[dict[str, Any], str], ...]] = ()

    def make_layer(self, cache: KVCache, layer_idx: int) -> CacheLayerMixin:
        """The cache layer object for decoder layer ``layer_idx`` (full-attention layers only)."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The option values of this instance."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """``name:key=value,...`` with the options that differ from their defaults."""
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return self.name + (":" + ",".join(changed) if changed else "")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, summary, capabilities and options (name, type, default, help) for CLIs and docs."""
        hints = typing.get_type_hints(cls)
        return {
            "name": cls.name,
            "summary": cls.summary or (cls.__doc__ or "").strip().splitlines()[0],
            "capabilities": {
                c: getattr(cls, c)
                for c in ("exact", "evicts", "needs_positions", "cross_layer", "supports_batch")
            },
            "options": [
                {
                    "name": f.name,
                    "type": _type_name(hints.get(f.name)),
                    "default": f.default,
                    "help": f.metadata.get("help", ""),
                }
                for f in dataclasses.fields(cls)
            ],
        }

    def replays_prefill(self, config: Any, tokens: int) -> bool:
        """Whether a ``tokens``-token prompt on a model with ``config`` is prefilled with exact attention, so
        that the evaluation may build this cache from one shared recorded prefill (``kvweave.eval.prefill``).
        Default: the class's ``exact_prefill``; methods exact only under some conditions refine it."""
        return self.exact_prefill

    # -- validation helpers used by subclasses' __post_init__
    def check_range(self, option_name: str, low: float | None = None, high: float | None = None) -> None:
        """Raise ``ValueError`` naming the option, its value and the allowed range when out of range."""
        value = getattr(self, option_name)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ValueError(f"{self.name}: option {option_name}={value!r} is out of range; allowed {bounds}")

    def check_choice(self, option_name: str, choices: typing.Iterable[Any]) -> None:
        """Raise ``ValueError`` naming the option, its value and the allowed values."""
        value, allowed = getattr(self, option_name), list(choices)
        if value not in allowed:
            raise ValueError(
                f"{self.name}: option {option_name}={value!r} is not allowed; choose one of {allowed}"
            )


def _type_name(hint: Any) -> str:
    if hint is None:
        return "any"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _convert(cls: type[Method], key: str, text: str) -> Any:
    """Turn an option given as text into the field's type."""
    hint = typing.get_type_hints(cls).get(key)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    for kind in args:
        try:
            if kind is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if kind in (int, float):
                return kind(text)
            if kind is str:
                return text
        except ValueError:
            continue
    raise ValueError(f"{cls.name}: option {key}={text!r} is not a valid {_type_name(hint)}")


def parse_method(spec: str | Method, **overrides: Any) -> Method:
    """A :class:`Method` from ``"name"``, ``"name:key=value,key=value"`` or an instance (+ keyword options)."""
    if isinstance(spec, Method):
        return dataclasses.replace(spec, **overrides) if overrides else spec
    name, _, rest = spec.strip().partition(":")
    import kvweave.methods  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise ValueError(
            f"unknown method {name!r}; available: {', '.join(sorted(METHODS))} (see `kvweave methods`)"
        )
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"{name}: option {item!r} needs the form key=value")
        options[key.strip()] = text.strip()
    unknown = sorted((set(options) | set(overrides)) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; allowed: {sorted(fields) or 'none'}")
    typed = {k: _convert(cls, k, v) for k, v in options.items()}
    return cls(**typed, **overrides)


def make_cache(method: str | Method = "full", model: Any = None, **options: Any) -> KVCache:
    """A ``transformers.Cache`` that compresses with ``method`` (prepares ``model`` for kvweave's attention)."""
    if model is None:
        raise ValueError("make_cache needs the model: kvweave.make_cache(method, model, **options)")
    chosen = parse_method(method, **options)
    if chosen.uses_kvweave_attention:
        prepare(model)
    return KVCache(chosen, model)


# ------------------------------------------------------------------------------------------------ cache


class KVCache(Cache):
    """A transformers ``Cache`` whose full-attention layers are built by a kvweave :class:`Method`."""

    def __init__(self, method: Method, model: Any) -> None:
        self.method = method
        self.config = text_config(model.config)
        if not method.exact and getattr(self.config, "kv_lora_rank", None):
            raise ValueError(
                f"{method.name}: this model caches multi-head latent attention (MLA) latents, not per-head keys "
                "and values; kvweave's compressed methods need a standard K/V cache. Use method 'full'."
            )
        self.num_kv_heads: int = self.config.num_key_value_heads
        self.head_dim: int = getattr(self.config, "head_dim", None) or (
            self.config.hidden_size // self.config.num_attention_heads
        )
        self.layer_types: list[str] = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        )
        rotary = find_rotary(model)
        self.rotary = {t: Rotary(rotary, t) for t in set(self.layer_types)} if rotary is not None else {}
        self.shared: dict[str, Any] = {}  # state shared between layers (cross-layer methods)
        self.replaying = False  # filled from a recorded prefill (kvweave.eval.prefill): outputs unused
        layers = default_layers(self.config)
        for idx, layer in enumerate(layers):
            if not getattr(layer, "is_sliding", False) and self.layer_types[idx] == "full_attention":
                layers[idx] = method.make_layer(self, idx)
        super().__init__(layers=layers)

    def set_prompt(self, token_ids: Any, tokenizer: Any = None) -> None:
        """Tell content-aware methods (DepthWeave's router) the prompt's token ids (``[n]`` or ``[B, n]``)
        and, optionally, the tokenizer that reads them. Methods that do not use them ignore both."""
        self.shared["token_ids"] = torch.as_tensor(token_ids)
        if tokenizer is not None:
            self.shared["tokenizer"] = tokenizer

    def rotary_for(self, layer_idx: int) -> Rotary:
        """The model's rotary embedding for ``layer_idx`` (error if the model has none)."""
        if not self.rotary:
            raise ValueError(f"{self.method.name} needs rotary position embeddings; this model has none")
        return self.rotary[self.layer_types[layer_idx]]

    def nbytes(self) -> int:
        """Bytes of all tensors this cache holds right now (each tensor storage counted once)."""
        return sum(layer_nbytes(layer) for layer in self.layers)

    def full_kv_bytes(self, bits: int = 16) -> int:
        """Bytes a transformers ``DynamicCache`` would hold for the same tokens, at ``bits`` per element."""
        total = 0
        for layer in self.layers:
            tokens = layer.get_seq_length()
            if getattr(layer, "is_sliding", False):
                tokens = min(tokens, max(getattr(layer, "sliding_window", tokens) - 1, 0))
            total += self.batch_rows() * self.elements_per_token() * tokens * bits // 8
        return total

    def elements_per_token(self) -> int:
        """K and V elements one token adds to one layer of a ``DynamicCache``."""
        latent = getattr(self.config, "kv_lora_rank", None)
        if latent:  # multi-head latent attention caches the latent and the shared RoPE key part
            return int(latent + self.config.qk_rope_head_dim)
        return 2 * self.num_kv_heads * self.head_dim

    def batch_rows(self) -> int:
        """Batch size seen by the cache (0 before the first update)."""
        for layer in self.layers:
            rows = getattr(layer, "rows", None)
            if rows:
                return int(rows)
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.dim() == 4:
                return keys.shape[0]
        return 0

    def stats(self) -> dict[str, Any]:
        """Per-layer detail: bytes held, entries held, tokens seen, and method-specific parts."""
        per_layer = []
        for idx, layer in enumerate(self.layers):
            entry = {
                "layer": idx,
                "kind": type(layer).__name__,
                "seen": layer.get_seq_length(),
                "bytes": layer_nbytes(layer),
            }
            if hasattr(layer, "layer_stats"):
                entry.update(layer.layer_stats())
            per_layer.append(entry)
        full = self.full_kv_bytes()
        held = self.nbytes()
        return {
            "method": self.method.spec(),
            "bytes": held,
            "full_kv_bytes_16bit": full,
            "compression": (full / held) if held else None,
            "layers": per_layer,
        }


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def layer_nbytes(layer: Any) -> int:
    """Bytes of the tensors a layer object holds (its attributes, lists and dicts of tensors)."""
    if hasattr(layer, "nbytes") and callable(layer.nbytes):
        return int(layer.nbytes())
    return tensors_nbytes(_tensors(list(vars(layer).values())))


def tensors_nbytes(tensors: typing.Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensor storages (views of one storage counted once, at the storage's size)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


# ---------------------------------------------------------------------------------------- compressed layer


class CompressedLayer(CacheLayerMixin):
    """Base for the layers of non-exact methods: the attention step is delegated to :meth:`attend`.

    The default store is exact entries ``keys, values: [B, H, T, D]`` with ``slots: [B, H, T]`` (int32);
    evicting methods override :meth:`after_attention` and call :meth:`keep`. Methods with their own storage
    override :meth:`append`, :meth:`attend` and :meth:`nbytes`.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0
        self.rows = 0
        self.slots: torch.Tensor | None = None  # [B, H, T] int32, None while entries are exactly 0..seen-1
        self.pad_count: torch.Tensor | None = None  # [B] left-padding tokens per row (set at prefill)

    # -- transformers' layer interface
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.rows = key_states.shape[0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new ``[B, H, q, D]`` tensors to kvweave's attention, which calls :meth:`attend`.

        A prefill (more than one new token) is checked for NaN/Inf first: compressing them would give garbage
        without a sign (one check per layer per prompt; single decode tokens are not checked, which would cost
        a device sync per layer per step)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] > 1 and not (torch.isfinite(key_states).all() and torch.isfinite(value_states).all()):
            raise ValueError(
                f"{self.cache.method.name}: layer {self.layer_idx} received NaN/Inf keys or values for "
                f"{key_states.shape[2]} new tokens, so the model's activations overflowed; a compressed cache "
                "cannot hold them. Run the model in float32 or bfloat16 (float16 overflows on long prompts), "
                "or check its weights."
            )
        mark_pending(self, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self, *args: Any) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx)  # type: ignore[misc]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{self.cache.method.name}: cropping a compressed cache is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` of every per-row tensor."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == self.rows:
                setattr(self, name, value.index_select(0, rows.to(value.device)))
        self.rows = len(rows)

    # -- kvweave's attention step
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Store the new tokens, attend over everything held, then let the method compress.

        ``query: [B, Hq, q, D]``, ``key, value: [B, H, q, D]`` (post-RoPE) -> ``[B, q, Hq, D]``.
        """
        q_len = key.shape[2]
        first = self.seen
        self.append(key, value, kwargs.get("position_ids"))
        self.seen += q_len
        if first == 0:
            self.record_padding(attention_mask)
        keys, values = self.attention_keys_values(query)
        if self.cache.replaying:  # shared-prefill replay: the output is known already, only the store matters
            out = query.new_empty(0)
        elif self.slots is None:  # nothing evicted: transformers' own path, exact
            out, _ = sdpa_attention(module, query, keys, values, attention_mask, **kwargs)
        else:
            mask = visible_mask(attention_mask, self.slots, first, q_len)
            out = masked_attention(query, keys, values, mask, kwargs.get("scaling"))
        self.after_attention(query, attention_mask, first)
        return out

    def append(self, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Add new exact entries (default store)."""
        keys = getattr(self, "keys", None)
        if keys is None or keys.numel() == 0:
            self.keys, self.values = key, value
        else:
            self.keys = torch.cat([keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)
        if self.slots is not None:
            self.slots = torch.cat([self.slots, self.new_slots(key.shape[2], key.shape[1])], dim=2)

    def new_slots(self, count: int, heads: int) -> torch.Tensor:
        """``[B, H, count]`` slots of the next ``count`` tokens."""
        slots = torch.arange(self.seen, self.seen + count, dtype=torch.int32, device=self.device)
        return slots.view(1, 1, -1).expand(self.rows, heads, -1).contiguous()

    def attention_keys_values(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention sees (default: the exact store)."""
        return self.keys, self.values  # type: ignore[return-value]

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        """Compression policy hook, called after each attention step (default: nothing)."""

    def held_slots(self) -> torch.Tensor:
        """``[B, H, T]`` slots of the held entries (materialised if still implicit)."""
        if self.slots is not None:
            return self.slots
        heads = self.keys.shape[1]  # type: ignore[union-attr]
        slots = torch.arange(self.keys.shape[2], dtype=torch.int32, device=self.device)  # type: ignore[union-attr]
        return slots.view(1, 1, -1).expand(self.rows, heads, -1).contiguous()

    def keep(self, index: torch.Tensor) -> None:
        """Keep entries ``index: [B, H, K]`` (positions into the held entries), in token order."""
        index = index.sort(dim=-1).values
        slots = self.held_slots().gather(2, index.to(torch.int64))
        gather = index.to(torch.int64).unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])  # type: ignore[union-attr]
        self.keys = self.keys.gather(2, gather).contiguous()  # type: ignore[union-attr]
        self.values = self.values.gather(2, gather).contiguous()  # type: ignore[union-attr]
        self.slots = slots.contiguous()

    def padding(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, 1, T]`` True where a held entry is a padding token (from the mask's last query row)."""
        mask = mask_to_bool(attention_mask)
        if mask is None:
            return None
        last_row = mask[:, 0, -1, :]  # [B, N]: the last token sees every real token before it
        held = self.held_slots()[:, :1, :].to(torch.int64)
        return ~last_row.unsqueeze(1).gather(2, held.clamp(max=last_row.shape[-1] - 1))

    def record_padding(self, attention_mask: torch.Tensor | None) -> None:
        """At prefill: count each row's left padding (``pad_count: [B]``) from the mask."""
        padding = self.padding(attention_mask)
        self.pad_count = (
            padding[:, 0].sum(-1)
            if padding is not None
            else torch.zeros(self.rows, dtype=torch.int64, device=self.device)
        )

    def padding_flags(self) -> torch.Tensor:
        """``[B, T]`` int 1 where a held entry (head 0) is a left-padding token."""
        slots = self.held_slots()[:, 0].to(torch.int64)
        if self.pad_count is None:
            return torch.zeros_like(slots)
        return (slots < self.pad_count.view(-1, 1)).to(torch.int64)

    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds."""
        return tensors_nbytes(_tensors([v for k, v in vars(self).items() if k != "cache"]))

    def entries(self) -> int:
        """Entries held per (row, head)."""
        keys = getattr(self, "keys", None)
        return 0 if keys is None else int(keys.shape[2])

    def layer_stats(self) -> dict[str, Any]:
        """Method-specific detail for :meth:`KVCache.stats`."""
        return {"entries": self.entries()}
