"""``dkcache``: DK-Cache, the tiered decoupled KV cache of seed ``000`` (§四, with the deployment rules of §六).

What it implements (DESIGN.md, "DK-Cache"):

- **Tiers by recency**, one set of boundaries (token indices) for the whole left-padded batch (seed rule 3):
  *core* = the most recent ``core`` tokens, exact; *steady* = recency ``core .. steady``, keys decoupled;
  *far* = older tokens, out of per-step attention. The first ``sinks`` real tokens of each row (attention
  sinks, Xiao et al. 2023) always attend. Tokens move core -> steady -> far as decoding proceeds. Defaults
  scale with the trained context ``L`` (``max_position_embeddings``): the seed's 128K model has core 8K and
  steady up to 64K, so core = ``L/16``, steady = ``L/2`` (``steady`` is a recency bound: the steady tier holds
  ``steady − core`` tokens). ``attended`` sets sinks+core+steady (what each step attends, besides retrieved pages) to a fraction of the prompt (its longest row).
- **Decoupling** ``K̂ = K − α·mean(K_steady)`` per (row, KV head) on the steady tier's keys only, the mean kept
  up to date with a running sum as tokens enter and leave the tier. α ∈ [0.25, 0.5], default 0.38; profiles
  ``chat`` 0.30 and ``code`` 0.42 (seed rule 1). Values are never decoupled (seed rule 2).
  *Where*: with ``key_storage="pre_rope"`` (default) the mean and the shift are taken on pre-RoPE keys (the
  token's content, what the seed's covariance argument is about) and the decoupled key is then rotated at
  whatever position attention uses, so decoupling and angle compensation compose. The logit of steady key
  ``j`` moves by ``−α·q·R(p_j)·m``: position dependent, so attention *within* the steady tier changes too.
  With ``key_storage="post_rope"`` the mean is taken on post-RoPE keys and the logit shift ``−α·q·m`` is the
  same for every steady key of a query: only the steady tier's mass relative to core/far moves.
- **Far tier** stored per row from the row's first real token (padding is never stored there), in pages of
  ``page`` tokens with per-channel min/max summaries of the keys as attention sees them (rotated at their
  attention positions), so ``Σ_d max(q_d·min_d, q_d·max_d)`` bounds ``q·k`` (Quest, Tang et al. 2024,
  arXiv:2406.10774). ``retrieve="always"``: the top ``pages`` pages per KV head join attention each step;
  ``"entropy"``: only after a step whose attention entropy (normalised by log of the entries attended)
  exceeded ``entropy_threshold``; ``"never"``: the far tier is dropped, the seed code's truncation. The far
  tier may be INT8 (per-token scales) and may live in host memory (``offload``).
- **RoPE angle compensation** (Self-Extend, Jin et al. 2024, arXiv:2401.01325): keys are stored pre-RoPE and
  rotated at attention time. A pair (query ``i``, key ``j``) with ``i − j < core`` keeps its exact relative
  position; farther pairs use grouped positions, query ``i // G + core − core // G`` and key ``j // G``, with
  the smallest ``G`` (per row, per step) that keeps every relative position below the trained length. Queries
  inside the trained range (position < trained length) keep exact positions for every key, so the mapping is
  the identity until the context outgrows the trained range. Compensation needs the RoPE inverse to be exact:
  rotary embeddings with an attention scaling other than 1 (YaRN) are not exactly invertible by the helper.
- INT8 steady/far storage (``bits=8``, the default since the performance work: per-token float32 scales, read by
  a fused C++ CPU kernel straight from the codes, :mod:`kvweave.kernels.cpu_int8`, which also takes the one
  softmax over the tiers without concatenating them; ``kernel=torch`` dequantizes and concatenates, the
  reference); ``bits=16`` keeps them at the model's width. INT4 is refused (seed rule 5). The core stays at
  the model's width. INT8 with one float32 scale per 64-value token row bounds the steady and far tiers at
  16 / 8.5 = 1.88x less than 16-bit.
- Defaults that differ from the seed: decoupling is **off** (``decouple=false``) because every measurement
  (NIAH at 8K and 16K, stepwise perplexity, passkey on smollm2) found it costly; ``decouple=true`` is the seed's
  rule 1.

What measuring it says (see :func:`measure_key_shift`): subtracting one vector from *every* key leaves softmax
attention unchanged (``q·c`` is the same for all keys of a query), so the seed's own code — which de-means the
whole key tensor — is a no-op. Shifting only the steady tier does change attention; how much, and whether it
helps, is what the evaluation measures. Prefill attention is exact over the whole prompt (as in kvpress; at
compensated positions beyond the trained range); the tiers shape decoding. Per step, attention sees sinks +
retrieved pages + steady + core (``attended_entries`` in the layer stats) while the cache holds every tier
(``entries``). Cost note: while every position is exact (the context inside the trained range) keys are held
as the model gives them (post-RoPE) even with ``key_storage="pre_rope"``: the pre-RoPE decoupling shift
``−α·q·R(p_j)·m`` is added to the steady logits as a bias (two small matmuls against the RoPE table), and each
decode step computes logits per tier with no key copied or rotated. When the context first outgrows the trained
range, every held key is de-rotated once. From then on (one sequence, or a batch without padding) the steady and
far keys are held rotated at their grouped positions ``p // G`` and re-rotated only when ``G`` grows: no steady or
far key is ever a neighbour of the query (the core holds the newest ``core`` tokens), so they only meet the
grouped query, and only the small core tier is rotated each step. Padded batches take the general path, which
rotates every attended key each step.

Attention paths (option ``path``): ``fast`` (default) is the fused CPU prefill beyond the trained range
(:func:`~kvweave.methods.dkcache.attention.flash_remapped_prefill`, ``flash_chunk`` queries at a time) and the
per-tier decode above; ``reference`` is the general masked path (tiers concatenated, the chunked
:func:`~kvweave.methods.dkcache.attention.remapped_attention`), for testing. ``hold_rotated=false`` holds
pre-RoPE keys pre-RoPE from the start and rotates the attended ones every step (the reference of the holding).

Modules: :mod:`.tiers` (growing buffers, core and steady tiers, decoupling helpers), :mod:`.far` (far pages,
summaries, retrieval), :mod:`.positions` (Self-Extend remapping), :mod:`.attention` (the attention
computations), :mod:`.layer` (:class:`DKCacheLayer`); the options are :class:`DKCache`, here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from kvweave.kernels.registry import BACKENDS
from kvweave.methods.dkcache.attention import attention_probs, flash_remapped_prefill, remapped_attention
from kvweave.methods.dkcache.far import far_device, page_upper_bounds
from kvweave.methods.dkcache.layer import DKCacheLayer
from kvweave.methods.dkcache.positions import (
    default_bounds,
    group_size,
    grouped_query_positions,
    is_near,
    remapped_distance,
)
from kvweave.methods.dkcache.tiers import decouple_keys, measure_key_shift, steady_mean
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache

__all__ = [
    "ALPHA_RANGE",
    "INT4_REFUSED",
    "PATHS",
    "PROFILE_ALPHA",
    "VALUE_DECOUPLING_REFUSED",
    "DKCache",
    "DKCacheLayer",
    "attention_probs",
    "decouple_keys",
    "default_bounds",
    "far_device",
    "flash_remapped_prefill",
    "group_size",
    "grouped_query_positions",
    "is_near",
    "measure_key_shift",
    "page_upper_bounds",
    "remapped_attention",
    "remapped_distance",
    "steady_mean",
]

PROFILE_ALPHA = {"default": 0.38, "chat": 0.30, "code": 0.42}  # seed §四.2 and rule 1
ALPHA_RANGE = (0.25, 0.5)
PATHS = ("fast", "reference")  # implementation setting ``path``
VALUE_DECOUPLING_REFUSED = (
    "dkcache: option decouple_values=True is refused: values carry the content attention returns, so shifting "
    "them changes every output (seed rule 2: only keys carry the temporal coupling; decoupling V breaks the "
    "feature mapping). Keys only."
)
INT4_REFUSED = (
    "dkcache: option bits=4 is refused: DK-Cache allows INT8 but forbids INT4 (seed rule 5), because 4-bit keys "
    "make the steady tier's mean/covariance unstable and decoupling stops working. Use bits=8 or bits=16."
)


@register("dkcache")
@dataclasses.dataclass
class DKCache(Method):
    """DK-Cache: core/steady/far tiers, steady-key decoupling, paged far retrieval, RoPE angle compensation."""

    vllm: ClassVar[str] = (
        "not served whole by the vLLM plugin: its far-tier page retrieval alone is the plugin's 'pages' "
        "method (no tiers, decoupling or compensation: they rewrite keys vLLM has already stored)"
    )

    core: int | None = option(None, "most recent tokens kept exact (default: trained context / 16)")
    steady: int | None = option(
        None,
        "recency bound of the steady tier in tokens (default: trained context / 2); older tokens are far",
    )
    attended: float | None = option(
        None,
        "core+steady+sinks attended per step as a fraction of the prompt (longest row), set at "
        "prefill; overrides core/steady. Retrieved far pages come on top",
    )
    sinks: int = option(4, "first real tokens of each row always in attention (attention sinks)", tuning=True)
    decouple: bool = option(
        False,
        "de-mean the steady tier's keys: K - alpha * mean(K_steady) (the seed's rule 1; off by default: it cost NIAH "
        "and perplexity in every measurement, docs/findings.md)",
    )
    alpha: float | None = option(
        None, "decoupling strength in [0.25, 0.5] (default: the profile's, 0.38)", tuning=True
    )
    profile: str = option(
        "default", "alpha preset: default 0.38, chat 0.30, code 0.42 (seed rule 1)", tuning=True
    )
    key_storage: str = option(
        "pre_rope",
        "pre_rope: keys de-rotated, decoupled pre-RoPE and rotated at attention "
        "time; post_rope: stored as the model gives them",
    )
    rope_compensation: bool | None = option(
        None,
        "Self-Extend position remapping beyond the trained range "
        "(default: on with pre_rope keys; identity inside the range)",
    )
    trained_length: int | None = option(
        None, "the model's trained context (default: max_position_embeddings)"
    )
    page: int = option(64, "far-tier page size in tokens", tuning=True)
    pages: int = option(16, "far pages per KV head joining attention per step (top upper bound of q.k)")
    retrieve: str = option(
        "always",
        "always: top pages each step; entropy: only after a high-entropy step; "
        "never: drop the far tier (the seed code's truncation)",
    )
    entropy_threshold: float = option(
        0.6,
        "retrieve=entropy: attention entropy / log(entries) of the last step "
        "above which far pages are retrieved",
        tuning=True,
    )
    bits: int = option(
        8, "steady and far storage: 8 = INT8 per token (the default), 16 = exact at `storage` (4 is refused)"
    )
    far_dtype: str = option(
        "model",
        "far-tier storage: model (exact, at `storage`) or int8 (per-token scales)",
        tuning=True,
    )
    storage: str = option("auto", STORAGE_HELP)
    offload: bool = option(False, "keep the far tier in host memory when the model is on an accelerator")
    kernel: str = option(
        "auto",
        "decode kernels: cpp (the tiers' products straight from the INT8 codes and the softmax over the tiers in "
        "C++, CPU), triton (far pages scored in "
        "a Triton kernel, CUDA), torch (the references) or auto (triton on CUDA, cpp on CPU when it builds)",
        tuning=True,
    )

    # Implementation settings, not options: no spec string carries them, results do not depend on them (tests
    # hold the fast paths equal to the reference), and tests and benchmarks set them on an instance with
    # :meth:`implementation`.
    path: ClassVar[str] = "fast"
    """``fast``: the fused CPU prefill beyond the trained range and decode logits per tier with no tier copied;
    ``reference``: the general masked path over the concatenated tiers."""
    hold_rotated: ClassVar[bool] = True
    """pre-RoPE storage: hold keys post-RoPE while every position is exact, de-rotated once when compensation
    starts (``False``: pre-RoPE from the start, attended keys rotated every step; the reference)."""
    flash_chunk: ClassVar[int] = 1024
    """Queries per chunk of the fused compensated prefill (``path="fast"``)."""
    refused_options: ClassVar[dict[str, str]] = {"decouple_values": VALUE_DECOUPLING_REFUSED}

    evicts = True  # per-step attention sees a subset; retrieve=never drops the far tier
    needs_positions = True
    # Prompts beyond the trained range are attended at remapped positions, and whether a prompt is beyond it
    # is not known when the evaluation decides whether to replay a shared exact prefill: always a real one.
    exact_prefill = False
    budget_options = {"attended": "attended fraction", "bits": "bits"}
    renamed_options = {"ratio": "attended"}
    test_options = {"core": 4, "steady": 16, "page": 8, "pages": 2, "sinks": 2, "far_dtype": "int8"}
    invalid_options = (
        ({"alpha": 0.6}, "alpha"),
        ({"profile": "poetry"}, "profile"),
        ({"decouple_values": True}, "decouple_values"),
        ({"bits": 4}, "bits"),
        ({"bits": 12}, "bits"),
        ({"retrieve": "sometimes"}, "retrieve"),
        ({"core": 0}, "core"),
        ({"core": 8, "steady": 4}, "steady"),
        ({"page": 0}, "page"),
        ({"pages": 0}, "pages"),
        ({"attended": 1.5}, "attended"),
        ({"sinks": -1}, "sinks"),
        ({"far_dtype": "int4"}, "far_dtype"),
        ({"key_storage": "rotated"}, "key_storage"),
        ({"entropy_threshold": 2.0}, "entropy_threshold"),
        ({"key_storage": "post_rope", "rope_compensation": True}, "rope_compensation"),
        ({"trained_length": 1}, "trained_length"),
    )

    def __post_init__(self) -> None:
        if self.bits == 4:
            raise ValueError(INT4_REFUSED)
        self.check_choice("bits", [8, 16])
        self.check_choice("profile", list(PROFILE_ALPHA))
        if self.alpha is not None:
            self.check_range("alpha", *ALPHA_RANGE)
        for name in ("core", "steady", "trained_length"):
            if getattr(self, name) is not None:
                self.check_range(name, 2 if name == "trained_length" else 1)
        if self.core is not None and self.steady is not None and self.steady < self.core:
            raise ValueError(
                f"dkcache: option steady={self.steady} is out of range; allowed [core={self.core}, inf] "
                "(steady is the recency bound of the steady tier, so it includes the core)"
            )
        if self.attended is not None:
            self.check_range("attended", 1e-6, 1.0)
        self.check_range("sinks", 0)
        self.check_range("page", 1)
        self.check_range("pages", 1)
        self.check_choice("retrieve", ["always", "entropy", "never"])
        self.check_range("entropy_threshold", 0.0, 1.0)
        self.check_choice("key_storage", ["pre_rope", "post_rope"])
        self.check_choice("far_dtype", ["model", "int8"])
        self.check_choice("storage", STORAGE_CHOICES)
        self.check_choice("kernel", BACKENDS)
        if self.rope_compensation and self.key_storage == "post_rope":
            raise ValueError(
                "dkcache: option rope_compensation=True needs key_storage='pre_rope' (keys are rotated "
                "at remapped positions at attention time); allowed with post_rope: False or None"
            )

    def implementation(
        self, path: str | None = None, hold_rotated: bool | None = None, flash_chunk: int | None = None
    ) -> DKCache:
        """A copy of this method with implementation settings changed (tests and benchmarks compare the fast
        paths against the references with it; the spec, and so every result row, is the same)."""
        chosen = dataclasses.replace(self)
        if path is not None:
            if path not in PATHS:
                raise ValueError(f"dkcache: path={path!r}; allowed: {', '.join(map(repr, PATHS))}")
            chosen.path = path  # type: ignore[misc]
        if hold_rotated is not None:
            chosen.hold_rotated = bool(hold_rotated)  # type: ignore[misc]
        if flash_chunk is not None:
            if flash_chunk < 1:
                raise ValueError(f"dkcache: flash_chunk={flash_chunk} must be >= 1")
            chosen.flash_chunk = int(flash_chunk)  # type: ignore[misc]
        return chosen

    @property
    def effective_alpha(self) -> float:
        """α in use: the ``alpha`` option, else the profile's."""
        return self.alpha if self.alpha is not None else PROFILE_ALPHA[self.profile]

    @property
    def remaps_positions(self) -> bool:
        """Whether RoPE angle compensation is on."""
        return self.key_storage == "pre_rope" and self.rope_compensation is not False

    def replays_prefill(self, config: Any, tokens: int) -> bool:
        """Prefill attention is exact (plain SDPA) unless angle compensation remaps positions, which it does
        only for prompts longer than the trained context."""
        trained = self.trained_length or int(config.max_position_embeddings)
        return not self.remaps_positions or tokens <= trained

    def bounds(self, trained: int) -> tuple[int, int]:
        """``(core, steady)`` in tokens: the options, else the seed's fractions of the trained context."""
        default_core, default_steady = default_bounds(trained)
        core = self.core if self.core is not None else min(default_core, self.steady or default_core)
        steady = self.steady if self.steady is not None else max(default_steady, core)
        return core, steady

    def make_layer(self, cache: KVCache, layer_idx: int) -> DKCacheLayer:
        return DKCacheLayer(cache, layer_idx, self)
