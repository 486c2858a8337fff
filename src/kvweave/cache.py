"""The cache framework: ``KVCache`` (a ``transformers.Cache``), its shared context and the base cache layer.

Storage is not policy. ``KVCache`` is a list of per-layer objects, like transformers' ``DynamicCache``;
each compression method is a small options dataclass (:class:`kvweave.registry.Method`), registered by name,
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
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from kvweave._compat import Cache, CacheLayerMixin, default_layers, mask_to_bool, sdpa_attention, text_config
from kvweave.attention import mark_pending, prepare
from kvweave.ops.attention import masked_attention
from kvweave.ops.masking import visible_mask
from kvweave.ops.rope import RopeTable, Rotary, find_rotary
from kvweave.ops.storage import storage_dtype
from kvweave.prompt import tokenizer_for
from kvweave.registry import Method, parse_method
from kvweave.state import Stateful
from kvweave.tp import local_kv_heads, tensor_parallel


def make_cache(
    method: str | Method = "full", model: Any = None, tokenizer: Any = None, **options: Any
) -> KVCache:
    """A ``transformers.Cache`` that compresses with ``method`` (prepares ``model`` for kvweave's attention).

    ``options`` override the method's (``make_cache("quant", model, bits=4)``). ``tokenizer`` is what
    content-aware methods read token ids with; by default the one :func:`kvweave.load_model` returned for
    ``model``, else the one in the model's local folder. The token ids themselves reach the cache by
    themselves: every forward pass of a prepared model hands over its ``input_ids``.
    """
    if model is None:
        raise ValueError("make_cache needs the model: kvweave.make_cache(method, model, **options)")
    chosen = parse_method(method, **options)
    if chosen.uses_kvweave_attention or chosen.reads_token_ids:
        prepare(model)
    return KVCache(chosen, model, tokenizer)


# ------------------------------------------------------------------------------------------------ cache


ID_DTYPE = torch.int32
"""How the cache holds token ids (every vocabulary fits; 4 bytes a position, counted where a method reads them)."""


def as_ids(token_ids: Any) -> torch.Tensor:
    """``token_ids`` (a tensor, list or array of integers) as a tensor of :data:`ID_DTYPE`; a one-line error for
    anything else (floats, values outside int32)."""
    ids = torch.as_tensor(token_ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"token ids must be integers, got {ids.dtype}: pass the tokenizer's input_ids")
    if (
        ids.dtype != ID_DTYPE
        and ids.numel()
        and (int(ids.min()) < 0 or int(ids.max()) > torch.iinfo(ID_DTYPE).max)
    ):
        raise ValueError("token ids must lie in 0 .. 2**31 - 1: pass the tokenizer's input_ids")
    return ids.to(ID_DTYPE)


@dataclasses.dataclass
class StepPositions(Stateful):
    """The RoPE positions of one forward call, computed once and read by every layer of the cache."""

    positions: torch.Tensor  # [B, q] int64
    row_lengths: list[int]  # per row: largest position + 1
    aligned: bool  # every row's positions are its slots (no padding, no offset)


class CacheContext(Stateful):
    """What the layers of one cache share, typed: the prompt, RoPE tables, step positions, layer groups.

    Saved in a cache file: the prompt ids and the layer groups (cross-layer state). Rebuilt from the model:
    the RoPE tables. Per call, never saved: the step positions, the recorded prefill steps. Not kvweave's:
    the tokenizer (``cache.set_prompt(ids, tokenizer)`` again after loading).
    """

    state_fields = ("prompt_ids", "groups")

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        # token ids seen so far ([B, n] or [n]), in the pieces the forward passes gave: a decode step appends
        # its id without copying the rest; :attr:`prompt_ids` joins them when a method reads them
        self._id_parts: list[torch.Tensor] = []
        self.tokenizer: Any = None
        self.groups: dict[int, Any] = {}  # cross-layer methods' layer groups, by group index
        self.rope_tables: dict[str, RopeTable] = {}  # by layer type
        self.recorded: dict[int, Any] = {}  # kvweave.eval.prefill: each layer's recorded prefill step
        self._step: tuple[Any, tuple[int, int, int], StepPositions] | None = None
        # a method's decode-time state derived from what is saved (DepthWeave's recall), rebuilt after a load
        self.decode_state: Any = None
        self._warned: set[str] = set()

    @property
    def prompt_ids(self) -> torch.Tensor | None:
        """The token ids of positions ``0 ..`` (``[B, n]``, or ``[n]`` as ``set_prompt`` gave them): what
        content-aware methods read (DepthWeave's router), saved in a cache file."""
        if len(self._id_parts) > 1:
            parts = [p.view(1, -1) if p.dim() == 1 else p for p in self._id_parts]
            rows, device = max(p.shape[0] for p in parts), parts[-1].device
            self._id_parts = [torch.cat([p.to(device).expand(rows, -1) for p in parts], dim=1)]
        return self._id_parts[0] if self._id_parts else None

    @prompt_ids.setter
    def prompt_ids(self, ids: torch.Tensor | None) -> None:
        self._id_parts = [] if ids is None else [as_ids(ids)]

    def observe(self, input_ids: torch.Tensor, first: int) -> None:
        """Keep ``input_ids: [B, q]`` as the ids of positions ``first .. first+q-1``: the first pass sets
        :attr:`prompt_ids`, a pass that continues them appends, ids already held (``set_prompt``) are kept.
        A pass after a gap (ids never seen for earlier positions) is not kept: positions would not line up."""
        ids = input_ids.detach().to(ID_DTYPE)
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        held = sum(int(p.shape[-1]) for p in self._id_parts)
        if held == first:
            self._id_parts.append(ids)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` of the ids (beam reorder, a row taken out of a batch, rows repeated): ids of
        one row (``[n]`` or ``[1, n]``, every row's) are left as they are. A method's decode-time state is
        dropped (DepthWeave's recall spans, of the rows before: matched again from the ids)."""
        ids = self.prompt_ids
        if ids is not None and ids.dim() == 2 and ids.shape[0] > 1:
            self.prompt_ids = ids.index_select(0, rows.to(ids.device))
        self.decode_state = None

    def warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` once per cache and ``key``."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    def rope_table(self, layer_idx: int) -> RopeTable:
        """The shared ``cos, sin`` table of ``layer_idx``'s layer type (one per type, grown on demand)."""
        layer_type = self.cache.layer_types[layer_idx]
        table = self.rope_tables.get(layer_type)
        if table is None:
            table = self.rope_tables[layer_type] = RopeTable(self.cache.rotary_for(layer_idx))
        return table

    def step_positions(
        self, position_ids: torch.Tensor | None, first: int, q_len: int, rows: int, device: torch.device
    ) -> StepPositions:
        """Positions of the forward call that gives tokens ``first .. first+q_len-1`` (``position_ids: [1 or B,
        q]`` or ``None``: the slots). Computed by the first layer, reused by the others: one host sync per call."""
        key = (first, q_len, rows)
        if self._step is not None and self._step[0] is position_ids and self._step[1] == key:
            return self._step[2]
        if position_ids is None:
            positions = torch.arange(first, first + q_len, device=device).view(1, -1)
        else:
            positions = position_ids.to(device, torch.int64)
        positions = positions.expand(rows, -1)
        slots = torch.arange(first, first + q_len, device=device).view(1, -1)
        lengths, aligned = torch.stack([positions.amax(-1) + 1, (positions == slots).all(-1).long()]).tolist()
        step = StepPositions(positions, [int(n) for n in lengths], all(aligned))
        self._step = (position_ids, key, step)
        return step


class KVCache(Cache):
    """A transformers ``Cache`` whose full-attention layers are built by a kvweave :class:`Method`."""

    def __init__(self, method: Method, model: Any, tokenizer: Any = None) -> None:
        self.method = method
        self.config = text_config(model.config)
        if not method.exact and getattr(self.config, "kv_lora_rank", None):
            raise ValueError(
                f"{method.name}: this model caches multi-head latent attention (MLA) latents, not per-head keys "
                "and values; kvweave's compressed methods need a standard K/V cache. Use method 'full'."
            )
        # under tensor parallelism (kvweave.distributed) this rank's share of the KV heads, from global head
        # ``kv_head_offset`` on; in one process all of them, from 0
        self.tp = tensor_parallel(model)
        self.num_kv_heads: int = local_kv_heads(self.config, self.tp)
        self.kv_head_offset: int = self.tp.rank * self.num_kv_heads if self.tp is not None else 0
        self.head_dim: int = getattr(self.config, "head_dim", None) or (
            self.config.hidden_size // self.config.num_attention_heads
        )
        self.layer_types: list[str] = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        )
        rotary = find_rotary(model)
        self.rotary = {t: Rotary(rotary, t) for t in set(self.layer_types)} if rotary is not None else {}
        self.context = CacheContext(self)  # what the layers share (positions, RoPE tables, prompt, groups)
        if method.reads_token_ids:
            self.context.tokenizer = tokenizer if tokenizer is not None else tokenizer_for(model)
        self.replaying = False  # filled from a recorded prefill (kvweave.eval.prefill): outputs unused
        layers = default_layers(self.config)
        for idx, layer in enumerate(layers):
            if not getattr(layer, "is_sliding", False) and self.layer_types[idx] == "full_attention":
                layers[idx] = method.make_layer(self, idx)
        super().__init__(layers=layers)
        method.bind_layers(self)

    def set_prompt(self, token_ids: Any, tokenizer: Any = None) -> None:
        """Override what content-aware methods (DepthWeave's router) read: the token ids from position 0 on
        (``[n]`` or ``[B, n]``) and, optionally, the tokenizer. Not needed on any path through a prepared model
        (each forward pass hands its ids over, :meth:`observe_input_ids`); ids given here are kept and later
        passes only append. Methods that do not read token ids ignore both."""
        self.context.prompt_ids = token_ids
        if tokenizer is not None:
            self.context.tokenizer = tokenizer

    def observe_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """A forward pass's ``input_ids: [B, q]`` (``None`` for ``inputs_embeds``), before its layers run: kept
        at the positions they fill for methods that read token ids (:attr:`Method.reads_token_ids`)."""
        if not self.method.reads_token_ids:
            return
        if input_ids is None:
            self.context.warn_once(
                "ids",
                f"{self.method.name}: this forward pass gave inputs_embeds, not input_ids, so the method cannot "
                "read the prompt's tokens (its content signals score 0); pass input_ids, or give them with "
                "cache.set_prompt(ids) first",
            )
            return
        self.context.observe(input_ids, self.get_seq_length())
        if self.context.tokenizer is None:
            self.context.warn_once(
                "tokenizer",
                f"{self.method.name}: no tokenizer for this model, so the content rules (protect, content "
                "signal) see token ids but not their text; pass kvweave.make_cache(method, model, "
                "tokenizer=tokenizer) or load the model with kvweave.load_model",
            )

    def before_forward(self, decoder: Any) -> None:
        """Called by the prepared model's pre-hook after :meth:`observe_input_ids`, before the layers run: the
        method's ``before_forward(cache, decoder)`` where it has one (DepthWeave's ``recall``)."""
        hook = getattr(self.method, "before_forward", None)
        if hook is not None:
            hook(self, decoder)

    # -- batch rows: every layer's, and the ids the context keeps (what recall and the router read per row)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.context.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.context.select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        ids = self.context.prompt_ids
        rows = int(ids.shape[0]) if ids is not None and ids.dim() == 2 else 1
        self.context.select_rows(torch.arange(rows).repeat_interleave(repeats))

    def rotary_for(self, layer_idx: int) -> Rotary:
        """The model's rotary embedding for ``layer_idx`` (error if the model has none)."""
        if not self.rotary:
            raise ValueError(f"{self.method.name} needs rotary position embeddings; this model has none")
        return self.rotary[self.layer_types[layer_idx]]

    def nbytes(self) -> int:
        """Bytes of all tensors this cache holds right now (each tensor storage counted once), with what the
        method holds beside its layers (``method.context_tensors``: the token ids DepthWeave's recall reads)."""
        held = sum(layer_nbytes(layer) for layer in self.layers)
        return held + tensors_nbytes(self.method.context_tensors(self.context))

    def read_bytes(self) -> int:
        """Bytes one decode step reads from this cache: what each layer attends over (``layer.read_bytes()``
        where a method reads part of what it holds, e.g. DK-Cache's far tier), else everything held."""
        total = 0
        for layer in self.layers:
            reader = getattr(layer, "read_bytes", None)
            total += int(reader()) if callable(reader) else layer_nbytes(layer)
        return total

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
        """Per-layer detail: bytes held, entries held, tokens seen, and method-specific parts (under tensor
        parallelism also ``tp_rank`` and ``tp_size``: the numbers are this rank's)."""
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
            # under tensor parallelism: this rank's heads only (kvweave.distributed.summed_nbytes adds the ranks)
            **({"tp_rank": self.tp.rank, "tp_size": self.tp.size} if self.tp is not None else {}),
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


class CompressedLayer(CacheLayerMixin, Stateful):
    """Base for the layers of non-exact methods: the attention step is delegated to :meth:`attend`.

    The default store is exact entries ``keys, values: [B, H, T, D]`` with ``slots: [B, H, T]`` (int32);
    evicting methods override :meth:`after_attention` and call :meth:`keep`. Methods with their own storage
    override :meth:`append`, :meth:`attend` and :meth:`nbytes`.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    # what a cache file holds of every compressed layer; subclasses add theirs (``CompressedLayer.state_fields
    # + (...)``). Built from the cache and its method, never saved: ``cache``, ``layer_idx``, ``method``.
    state_fields: ClassVar[tuple[str, ...]] = (
        "is_initialized",
        "device",
        "dtype",
        "seen",
        "rows",
        "slots",
        "pad_count",
        "keys",
        "values",
    )
    # the tensors whose first dimension is the batch row: what beam search, batch repeats and row selection
    # reorder (:meth:`select_rows`); subclasses add theirs (a contract test finds any that is missing)
    batch_fields: ClassVar[tuple[str, ...]] = ("slots", "pad_count", "keys", "values")

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
        else:
            self.check_matches(key_states)
        if key_states.shape[2] > 1 and not (
            torch.isfinite(key_states).all() and torch.isfinite(value_states).all()
        ):
            raise ValueError(
                f"{self.cache.method.name}: layer {self.layer_idx} received NaN/Inf keys or values for "
                f"{key_states.shape[2]} new tokens, so the model's activations overflowed; a compressed cache "
                "cannot hold them. Run the model in float32 or bfloat16 (float16 overflows on long prompts), "
                "or check its weights."
            )
        mark_pending(self, key_states)
        return key_states, value_states

    def check_matches(self, key_states: torch.Tensor) -> None:
        """Refuse new keys whose batch size, dtype or device differ from what this layer holds: the cache was
        filled by another batch or model set-up, and continuing would mix them silently."""
        b, dtype, device = key_states.shape[0], key_states.dtype, key_states.device
        if (b, dtype, device) == (self.rows, self.dtype, self.device):
            return
        raise ValueError(
            f"{self.cache.method.name}: layer {self.layer_idx} holds {self.rows} rows of {self.dtype} on "
            f"{self.device} but was given {b} rows of {dtype} on {device}; a cache continues the batch and model "
            "it was filled with: make a new cache (kvweave.make_cache) for this input, or call cache.reset()"
        )

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
        """Keep batch rows ``rows`` of every tensor the class declares per row (:attr:`batch_fields`)."""
        for name in self.batch_fields:
            value = getattr(self, name, None)
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or (value.shape[0] == 0 < self.rows):
                continue  # not set yet (None, or the empty placeholder a layer holds before its first update)
            if value.shape[0] != self.rows:
                raise RuntimeError(
                    f"{type(self).__name__}.{name} is declared per batch row but holds {value.shape[0]} rows, "
                    f"not {self.rows}"
                )
            setattr(self, name, value.index_select(0, rows.to(value.device)))
        self.rows = len(rows)

    # -- kvweave's attention step
    def prompt_attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Exact attention of a prompt over its own keys and values (transformers' SDPA path); an empty tensor
        during a shared-prefill replay (``cache.replaying``), whose output is known already: only the store
        matters then."""
        if self.cache.replaying:
            return query.new_empty(0)
        return sdpa_attention(module, query, key, value, attention_mask, **kwargs)[0]

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
        # the prompt attends to its own exact keys and values; later steps to what the store holds
        keys, values = (key, value) if first == 0 else self.attention_keys_values(query)
        if self.cache.replaying or self.slots is None:  # nothing evicted: transformers' own path, exact
            out = self.prompt_attention(module, query, keys, values, attention_mask, **kwargs)
        else:
            mask = visible_mask(attention_mask, self.slots, first, q_len)
            out = masked_attention(query, keys, values, mask, kwargs.get("scaling"))
        self.after_attention(query, attention_mask, first)
        return out

    @property
    def store_dtype(self) -> torch.dtype:
        """The dtype exact entries are held in: the method's ``storage`` option (``kvweave.ops.storage``), the
        model's own for a method without one."""
        return storage_dtype(getattr(self.cache.method, "storage", "model"), self.dtype)

    def stored(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` at the store's width (no copy when it already is)."""
        return tensor.to(self.store_dtype)

    def computed(self, tensor: torch.Tensor) -> torch.Tensor:
        """A held ``tensor`` at the model's width, for attention (no copy when it already is)."""
        return tensor.to(self.dtype)

    def append(self, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Add new exact entries (default store, at :attr:`store_dtype`)."""
        key, value = self.stored(key), self.stored(value)
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
        """The keys and values attention sees (default: the exact store, at the model's width)."""
        return self.computed(self.keys), self.computed(self.values)  # type: ignore[arg-type]

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
