"""``dkcache``: DK-Cache, the tiered decoupled KV cache of seed ``000`` (§四, with the deployment rules of §六).

What it implements (DESIGN.md, "DK-Cache"):

- **Tiers by recency**, one set of boundaries (token indices) for the whole left-padded batch (seed rule 3):
  *core* = the most recent ``core`` tokens, exact; *steady* = recency ``core .. steady``, keys decoupled;
  *far* = older tokens, out of per-step attention. The first ``sinks`` real tokens of each row (attention
  sinks, Xiao et al. 2023) always attend. Tokens move core -> steady -> far as decoding proceeds. Defaults
  scale with the trained context ``L`` (``max_position_embeddings``): the seed's 128K model has core 8K and
  steady up to 64K, so core = ``L/16``, steady = ``L/2`` (``steady`` is a recency bound: the steady tier holds
  ``steady − core`` tokens). ``ratio`` sets sinks+core+steady to a fraction of the prompt (its longest row).
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
- INT8 steady/far storage (``bits=8``); INT4 is refused (seed rule 5).

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
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvweave._compat import mask_to_bool, sdpa_attention
from kvweave.cache import CompressedLayer, Method, option, register, tensors_nbytes
from kvweave.ops.attention import fused_part_attention, merge_parts
from kvweave.ops.masking import visible_mask
from kvweave.ops.quantize import dequantize_int8, quantize_int8
from kvweave.ops.rope import RopeTable, rotate_half

if TYPE_CHECKING:
    from kvweave.cache import KVCache

PROFILE_ALPHA = {"default": 0.38, "chat": 0.30, "code": 0.42}  # seed §四.2 and rule 1
ALPHA_RANGE = (0.25, 0.5)
VALUE_DECOUPLING_REFUSED = (
    "dkcache: option decouple_values=True is refused: values carry the content attention returns, so shifting "
    "them changes every output (seed rule 2: only keys carry the temporal coupling; decoupling V breaks the "
    "feature mapping). Keys only."
)
INT4_REFUSED = (
    "dkcache: option bits=4 is refused: DK-Cache allows INT8 but forbids INT4 (seed rule 5), because 4-bit keys "
    "make the steady tier's mean/covariance unstable and decoupling stops working. Use bits=8 or bits=16."
)
# Elements of one block of attention logits (float32) during a compensated prefill: ~128 MiB.
CHUNK_ELEMENTS = 1 << 25
GROWTH = 16
"""Tier buffers and the far store grow by 1/GROWTH of their size when full (slack counts as memory held: a
quarter made DK-Cache hold ~25 % more than its tokens after the first decode step; a copy per ~size/16 tokens
is cheap)."""
FAST_PREFILL = True
"""Compensated prefill of an unpadded prompt on the CPU through :func:`flash_remapped_prefill` (the chunked
:func:`remapped_attention` is the reference, and the path for padded batches and accelerators)."""
FLASH_CHUNK = 1024
"""Queries per chunk of :func:`flash_remapped_prefill`."""
HOLD_ROTATED = True
"""Hold keys post-RoPE while every position is exact, de-rotating them once when compensation starts (False: hold
them pre-RoPE from the start and rotate the attended ones every step, the reference)."""
FAST_DECODE = True
"""Decode steps at exact positions through :meth:`DKCacheLayer._exact_attention` (logits per tier, no tier copied
or rotated); the general :meth:`DKCacheLayer._tiered_attention` is the reference."""
FAST_COMPENSATED = True
"""Decode steps beyond the trained range (positions are slots, no padding) through
:meth:`DKCacheLayer._compensated_attention`: steady and far keys held rotated at their grouped positions (re-rotated
only when the Self-Extend group grows), logits per tier; the general path is the reference."""


@register("dkcache")
@dataclasses.dataclass
class DKCache(Method):
    """DK-Cache: core/steady/far tiers, steady-key decoupling, paged far retrieval, RoPE angle compensation."""

    core: int | None = option(None, "most recent tokens kept exact (default: trained context / 16)")
    steady: int | None = option(None, "recency bound of the steady tier in tokens (default: trained context / 2); "
                                      "older tokens are far")
    ratio: float | None = option(None, "core+steady+sinks as a fraction of the prompt (longest row), set at "
                                       "prefill; overrides core/steady. Retrieved far pages come on top")
    sinks: int = option(4, "first real tokens of each row always in attention (attention sinks)")
    decouple: bool = option(True, "de-mean the steady tier's keys: K - alpha * mean(K_steady)")
    alpha: float | None = option(None, "decoupling strength in [0.25, 0.5] (default: the profile's, 0.38)")
    profile: str = option("default", "alpha preset: default 0.38, chat 0.30, code 0.42 (seed rule 1)")
    decouple_values: bool = option(False, "refused: values are never decoupled (seed rule 2)")
    key_storage: str = option("pre_rope", "pre_rope: keys de-rotated, decoupled pre-RoPE and rotated at attention "
                                          "time; post_rope: stored as the model gives them")
    rope_compensation: bool | None = option(None, "Self-Extend position remapping beyond the trained range "
                                                  "(default: on with pre_rope keys; identity inside the range)")
    trained_length: int | None = option(None, "the model's trained context (default: max_position_embeddings)")
    page: int = option(64, "far-tier page size in tokens")
    pages: int = option(16, "far pages per KV head joining attention per step (top upper bound of q.k)")
    retrieve: str = option("always", "always: top pages each step; entropy: only after a high-entropy step; "
                                     "never: drop the far tier (the seed code's truncation)")
    entropy_threshold: float = option(0.6, "retrieve=entropy: attention entropy / log(entries) of the last step "
                                           "above which far pages are retrieved")
    bits: int = option(16, "steady and far storage: 16 = the model's dtype, 8 = INT8 per token (4 is refused)")
    far_dtype: str = option("model", "far-tier storage: model (the model's dtype) or int8 (per-token scales)")
    offload: bool = option(False, "keep the far tier in host memory when the model is on an accelerator")

    evicts = True  # per-step attention sees a subset; retrieve=never drops the far tier
    needs_positions = True
    # Prompts beyond the trained range are attended at remapped positions, and whether a prompt is beyond it
    # is not known when the evaluation decides whether to replay a shared exact prefill: always a real one.
    exact_prefill = False
    test_options = {"core": 4, "steady": 16, "page": 8, "pages": 2, "sinks": 2, "far_dtype": "int8"}
    invalid_options = (
        ({"alpha": 0.6}, "alpha"), ({"profile": "poetry"}, "profile"), ({"decouple_values": True}, "decouple_values"),
        ({"bits": 4}, "bits"), ({"bits": 12}, "bits"), ({"retrieve": "sometimes"}, "retrieve"), ({"core": 0}, "core"),
        ({"core": 8, "steady": 4}, "steady"), ({"page": 0}, "page"), ({"pages": 0}, "pages"),
        ({"ratio": 1.5}, "ratio"), ({"sinks": -1}, "sinks"), ({"far_dtype": "int4"}, "far_dtype"),
        ({"key_storage": "rotated"}, "key_storage"), ({"entropy_threshold": 2.0}, "entropy_threshold"),
        ({"key_storage": "post_rope", "rope_compensation": True}, "rope_compensation"),
        ({"trained_length": 1}, "trained_length"),
    )

    def __post_init__(self) -> None:
        if self.decouple_values:
            raise ValueError(VALUE_DECOUPLING_REFUSED)
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
            raise ValueError(f"dkcache: option steady={self.steady} is out of range; allowed [core={self.core}, inf] "
                             "(steady is the recency bound of the steady tier, so it includes the core)")
        if self.ratio is not None:
            self.check_range("ratio", 1e-6, 1.0)
        self.check_range("sinks", 0)
        self.check_range("page", 1)
        self.check_range("pages", 1)
        self.check_choice("retrieve", ["always", "entropy", "never"])
        self.check_range("entropy_threshold", 0.0, 1.0)
        self.check_choice("key_storage", ["pre_rope", "post_rope"])
        self.check_choice("far_dtype", ["model", "int8"])
        if self.rope_compensation and self.key_storage == "post_rope":
            raise ValueError("dkcache: option rope_compensation=True needs key_storage='pre_rope' (keys are rotated "
                             "at remapped positions at attention time); allowed with post_rope: False or None")

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


def default_bounds(trained: int) -> tuple[int, int]:
    """Seed bounds scaled to the model: 128K trained -> core 8K, steady to 64K, i.e. ``L/16`` and ``L/2``."""
    return max(1, trained // 16), max(1, trained // 2)


# ------------------------------------------------------------------------------------------ the math pieces


def steady_mean(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, 1, D]`` mean over the valid entries of ``keys: [B, H, T, D]`` (``valid: [B, T]``), per head."""
    weights = valid.to(keys.dtype).view(valid.shape[0], 1, -1, 1)
    return (keys * weights).sum(2, keepdim=True) / weights.sum(2, keepdim=True).clamp(min=1)


def decouple_keys(keys: torch.Tensor, mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``K̂ = K − α·mean`` (seed §四.2); ``keys: [B, H, T, D]``, ``mean: [B, H, 1, D]``."""
    return keys - alpha * mean.to(keys.dtype)


def measure_key_shift(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tier: torch.Tensor,
                      alpha: float = 0.38, scaling: float | None = None) -> dict[str, float]:
    """How ``K − α·mean(K_tier)`` changes softmax attention when applied to every key vs to the tier only.

    ``query: [B, Hq, q, D]``, ``keys, values: [B, H, T, D]`` as attention sees them (post-RoPE), ``tier: [T]`` or
    ``[B, T]`` bool (the steady tier's entries, whose mean is subtracted). Computed in float64. Returns the
    largest change of any attention probability and output element for the *uniform* shift (every key, what
    the seed's code does: a no-op up to rounding) and the *tier-only* shift (the seed's text, what ``dkcache``
    does), and the attention mass on the tier before and after the tier-only shift.
    """
    q, k, v = query.double(), keys.double(), values.double()
    b, hq, _, d = q.shape
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    tier = tier.to(torch.bool).expand(b, -1)
    mean = steady_mean(k, tier)
    scale = scaling if scaling is not None else d**-0.5

    def attend(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(q @ shifted.transpose(-1, -2) * scale, dim=-1)
        return probs, probs @ v

    probs, out = attend(k)
    uniform_probs, uniform_out = attend(decouple_keys(k, mean, alpha))
    in_tier = tier.view(b, 1, 1, -1)
    tier_probs, tier_out = attend(torch.where(in_tier.transpose(-1, -2), decouple_keys(k, mean, alpha), k))
    mass = (probs * in_tier).sum(-1).mean().item()
    return {
        "uniform_max_prob_change": (uniform_probs - probs).abs().max().item(),
        "uniform_max_output_change": (uniform_out - out).abs().max().item(),
        "tier_max_prob_change": (tier_probs - probs).abs().max().item(),
        "tier_max_output_change": (tier_out - out).abs().max().item(),
        "tier_mass_before": mass,
        "tier_mass_after": (tier_probs * in_tier).sum(-1).mean().item(),
    }


def group_size(length: int, window: int, trained: int) -> int:
    """Smallest Self-Extend group ``G`` that keeps every relative position of ``length`` tokens trained.

    Neighbours (distance < ``window``) keep exact positions; other pairs use ``(i // G + window − window // G) −
    j // G``, whose largest value is ``(length − 1) // G + window − window // G``; it must stay ``<= trained − 1``.
    ``1`` (the identity) while ``length <= trained``.
    """
    if length <= trained:
        return 1
    if window >= trained - 1:
        raise ValueError(f"dkcache: RoPE compensation needs core < trained length - 1 (core={window}, trained "
                         f"length={trained}); lower core or set rope_compensation=False")
    group = max(2, (length - 1 - window) // (trained - window))  # a lower bound of the answer
    while (length - 1) // group + window - window // group > trained - 1:
        group += 1
    return group


def remapped_distance(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int,
                      group: int | torch.Tensor, trained: int | None = None) -> torch.Tensor:
    """Relative position attention uses for each (query, key) pair under angle compensation (broadcasting).

    Exact for neighbours (distance < ``window``) and for queries inside the trained range (position <
    ``trained``: every distance they see was trained), grouped otherwise."""
    exact = query_positions - key_positions
    grouped = (query_positions // group + window - window // group) - key_positions // group
    return torch.where(is_near(query_positions, key_positions, window, trained), exact, grouped)


def is_near(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int,
            trained: int | None = None) -> torch.Tensor:
    """Pairs that keep exact RoPE positions: distance < ``window``, or a query inside the trained range."""
    near = query_positions - key_positions < window
    return near if trained is None else near | (query_positions < trained)


def grouped_query_positions(positions: torch.Tensor, groups: torch.Tensor, window: int) -> torch.Tensor:
    """Query positions for the grouped (far) part: ``i // G + window − window // G``; ``positions: [B, q]``."""
    groups = groups.view(-1, 1)
    return positions // groups + window - window // groups


def page_upper_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q·k`` over each page: ``Σ_d max(q_d·min_d, q_d·max_d)``, as two matmuls.

    ``query: [B, H, n, D]`` (a KV head's query rows), ``page_min, page_max: [B, H, P, D]`` -> ``[B, H, n, P]``.
    """
    q = query.float()
    return q.clamp(min=0) @ page_max.transpose(-1, -2) + q.clamp(max=0) @ page_min.transpose(-1, -2)


def far_device(device: torch.device, offload: bool) -> torch.device:
    """Where the far tier lives: host memory when offloading from an accelerator, else with the model."""
    return torch.device("cpu") if offload and device.type != "cpu" else device


def remapped_attention(q_exact: torch.Tensor, q_grouped: torch.Tensor | None, k_exact: torch.Tensor,
                       k_grouped: torch.Tensor | None, values: torch.Tensor, visible: torch.Tensor,
                       near: torch.Tensor | None, scaling: float,
                       exact_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention whose near pairs use exact RoPE positions and the others grouped ones.

    ``q_*: [B, Hq, n, D]``, ``k_*, values: [B, H, T, D]``, ``visible, near: [B, H or 1, n, T]`` bool (``near``
    True: use ``q_exact·k_exact``, else ``q_grouped·k_grouped``; ``None``: exact only). ``exact_from``: no
    key before it is near any query (its exact logits are not computed). Returns the output
    ``[B, n, Hq, D]`` and ``[B]``: the last query's attention entropy / log(entries it sees), mean over heads.
    """
    b, hq, n, d = q_exact.shape
    h, t = k_exact.shape[1], k_exact.shape[2]
    groups = hq // h

    def logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # [B, H, groups, n, T']
        return (q.reshape(b, h, groups * n, d) @ k.to(q.dtype).transpose(-1, -2)).view(b, h, groups, n, -1)

    if q_grouped is not None and k_grouped is not None and near is not None:
        scores = logits(q_grouped, k_grouped)
        band = near[..., exact_from:].unsqueeze(2)
        scores[..., exact_from:] = torch.where(band, logits(q_exact, k_exact[:, :, exact_from:]),
                                               scores[..., exact_from:])
    else:
        scores = logits(q_exact, k_exact)
    probs, entropy = attention_probs(scores, visible, scaling)
    out = (probs.to(values.dtype).view(b, h, groups * n, t) @ values).view(b, hq, n, -1)
    return out.transpose(1, 2).contiguous(), entropy


def attention_probs(scores: torch.Tensor, visible: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``scores: [B, H, groups, n, T]`` (unscaled logits) over the ``visible: [B, H or 1, n, T]``
    entries, and ``[B]``: the last query's attention entropy / log(entries it sees), mean over heads."""
    seen = visible.unsqueeze(2)
    seen = seen | ~seen.any(-1, keepdim=True)  # a query that sees nothing (padding) sees all: never used
    probs = torch.softmax(scores.float().mul(scaling).masked_fill(~seen, float("-inf")), dim=-1)
    last = probs[:, :, :, -1, :]
    entropy = -torch.special.xlogy(last, last).sum(-1)
    count = seen[:, :, :, -1, :].sum(-1).expand_as(entropy).float()
    normalised = torch.where(count > 1, entropy / count.clamp(min=2).log(), torch.zeros_like(entropy))
    return probs, normalised.flatten(1).mean(1)


def flash_remapped_prefill(q_exact: torch.Tensor, q_grouped: torch.Tensor, k_exact: torch.Tensor,
                           k_grouped: torch.Tensor, values: torch.Tensor, window: int, trained: int,
                           scaling: float, chunk: int) -> torch.Tensor | None:
    """:func:`remapped_attention` over a whole unpadded prompt (positions ``0..n-1``), in fused CPU kernels.

    Per chunk of queries ``[low, high)`` that lies beyond the trained range, three parts merged by their
    log-sum-exp: grouped positions over the keys far from every query of the chunk (no mask), grouped over
    the boundary keys (``j <= i - window``) and exact over the neighbours (``i - window < j <= i``); inside
    the trained range exact causal attention (bulk + diagonal). Nothing ``n x n`` is materialised, which makes
    a 16K compensated prefill minutes instead of half an hour on a CPU. Returns ``[B, n, Hq, D]``, or ``None``
    if the kernel is not available (accelerators: the caller then uses :func:`remapped_attention`).
    """
    if q_exact.device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return None
    b, hq, n, d = q_exact.shape
    h = k_exact.shape[1]
    groups = hq // h
    outputs = []
    device = q_exact.device
    starts = sorted(set(range(0, n, chunk)) | ({trained} if 0 < trained < n else set()))  # no chunk straddles
    for low, high in zip(starts, starts[1:] + [n], strict=True):
        rows = torch.arange(low, high, device=device).view(-1, 1)
        if high <= trained:  # every query inside the trained range: exact and causal
            diag = torch.arange(low, high, device=device).view(1, -1) <= rows
            parts = [fused_part_attention(q_exact[:, :, low:high], k_exact[:, :, :low], values[:, :, :low], None, scaling),
                     fused_part_attention(q_exact[:, :, low:high], k_exact[:, :, low:high], values[:, :, low:high], diag,
                                 scaling)]
        else:
            cut, edge = max(0, low - window + 1), max(0, high - window + 1)
            far_cols = torch.arange(cut, edge, device=device).view(1, -1)
            near_cols = torch.arange(cut, high, device=device).view(1, -1)
            parts = [
                fused_part_attention(q_grouped[:, :, low:high], k_grouped[:, :, :cut], values[:, :, :cut], None, scaling),
                fused_part_attention(q_grouped[:, :, low:high], k_grouped[:, :, cut:edge], values[:, :, cut:edge],
                            far_cols <= rows - window, scaling),
                fused_part_attention(q_exact[:, :, low:high], k_exact[:, :, cut:high], values[:, :, cut:high],
                            (near_cols <= rows) & (near_cols > rows - window), scaling),
            ]
        c = high - low
        out = merge_parts(parts).view(b, h, groups, c, d).reshape(b, hq, c, d)
        outputs.append(out.to(q_exact.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------- storage


class _Buffer:
    """A tensor that grows at the end and shrinks at the front along ``dim`` without a copy per step."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.begin = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.begin

    def view(self) -> torch.Tensor:
        assert self.data is not None
        return self.data.narrow(self.dim, self.begin, len(self))

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self.data is None:
            self.data, self.begin, self.end = x.clone(memory_format=torch.contiguous_format), 0, n
            return
        if self.end + n > self.data.shape[self.dim]:
            needed = len(self) + n
            self._reallocate(needed + max(16, needed // GROWTH))
        self.data.narrow(self.dim, self.end, n).copy_(x)
        self.end += n

    def pop_front(self, n: int) -> torch.Tensor:
        """The first ``n`` entries (a view, valid until the next append) and drop them."""
        out = self.view().narrow(self.dim, 0, n)
        self.begin += n
        return out

    def fit(self) -> None:
        """Release capacity after a large move (prefill) so held bytes stay honest."""
        if self.data is not None and self.data.shape[self.dim] > 2 * len(self) + 32:
            self._reallocate(len(self))

    def _reallocate(self, capacity: int) -> None:
        live = self.view()
        shape = list(live.shape)
        shape[self.dim] = capacity
        data = live.new_empty(shape)
        data.narrow(self.dim, 0, live.shape[self.dim]).copy_(live)
        self.data, self.begin, self.end = data, 0, live.shape[self.dim]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, rows.to(self.data.device))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]


class _Tier:
    """Tokens of consecutive slots (the same slots in every row): ``keys, values: [B, H, T, D]``,
    ``positions: [B, T]`` (RoPE positions). INT8 tiers hold int8 entries and a float32 scale per token."""

    def __init__(self, quantized: bool) -> None:
        self.quantized = quantized
        self.parts = {name: _Buffer(2) for name in ("keys", "values", "key_scales", "value_scales")}
        self.positions = _Buffer(1)
        self.first_slot = 0

    def __len__(self) -> int:
        return len(self.positions)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Add entries; returns the keys as stored (dequantized), for the running mean."""
        if self.quantized:
            (keys_q, key_scales), (values_q, value_scales) = quantize_int8(keys), quantize_int8(values)
            for name, part in (("keys", keys_q), ("values", values_q), ("key_scales", key_scales),
                               ("value_scales", value_scales)):
                self.parts[name].append(part)
            keys = dequantize_int8(keys_q, key_scales, keys.dtype)
        else:
            self.parts["keys"].append(keys)
            self.parts["values"].append(values)
        self.positions.append(positions.to(torch.int32))
        return keys

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``keys, values`` (``dtype``) and ``positions`` (int64) of every entry."""
        return self._read({name: part.view() for name, part in self.parts.items() if part.data is not None},
                          self.positions.view(), dtype)

    def pop_front(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` entries."""
        parts = {name: part.pop_front(n) for name, part in self.parts.items() if part.data is not None}
        out = self._read(parts, self.positions.pop_front(n), dtype)
        self.first_slot += n
        return out

    def _read(self, parts: dict[str, torch.Tensor], positions: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.quantized:
            keys = dequantize_int8(parts["keys"], parts["key_scales"], dtype)
            values = dequantize_int8(parts["values"], parts["value_scales"], dtype)
        else:
            keys, values = parts["keys"], parts["values"]
        return keys, values, positions.to(torch.int64)

    def map_keys(self, fn: Any) -> None:
        """Replace every held key ``k`` by ``fn(k, positions)`` in place (``[B, H, T, D]``, ``[B, T]`` int64)."""
        if not len(self):
            return
        keys, _, positions = self.read(torch.float32)
        mapped = fn(keys, positions)
        if self.quantized:
            codes, scales = quantize_int8(mapped)
            self.parts["keys"].view().copy_(codes)
            self.parts["key_scales"].view().copy_(scales)
        else:
            self.parts["keys"].view().copy_(mapped)

    def fit(self) -> None:
        for part in (*self.parts.values(), self.positions):
            part.fit()

    def select_rows(self, rows: torch.Tensor) -> None:
        for part in (*self.parts.values(), self.positions):
            part.select_rows(rows)

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in (*self.parts.values(), self.positions) for t in part.tensors()]


def _write_range(buffer: torch.Tensor, dim: int, low: int, block: torch.Tensor, source: torch.Tensor,
                 uniform: int | None = None) -> None:
    """``buffer[b, .., low + w, ..] = block[b, .., source[b, w], ..]`` where ``0 <= source < n``, else unchanged.

    Rows write different entries of ``block`` at the same destination range without a host sync or a
    per-token loop: each destination gathers its source (``source: [B, W]`` int64). ``uniform``: the caller
    knows every row's source is ``uniform, uniform + 1, ..`` (no padding): a plain copy.
    """
    b, width = source.shape
    n = block.shape[dim]
    if uniform is not None and 0 <= uniform and uniform + width <= n:  # every row reads the same valid range
        buffer.narrow(dim, low, width).copy_(block.narrow(dim, uniform, width))
        return
    shape = [b] + [1] * (dim - 1) + [width] + [1] * (block.dim() - dim - 1)
    expand = list(block.shape)
    expand[dim] = width
    index = source.clamp(0, max(n - 1, 0)).view(shape).expand(expand)
    valid = ((source >= 0) & (source < n)).view(shape)
    target = buffer.narrow(dim, low, width)
    target.copy_(torch.where(valid, block.gather(dim, index), target))


class _FarTier:
    """Tokens older than the steady tier, stored per row by real-token index ``r = slot − pad`` (padding is
    never stored): the first ``sinks`` in an exact sink store, the rest (``r − sinks``) in pages of ``page``
    tokens with per-channel min/max key summaries (unless pages are dropped: ``retrieve="never"``)."""

    def __init__(self, sinks: int, page: int, quantized: bool, keep_pages: bool, device: torch.device) -> None:
        self.sinks, self.page, self.quantized, self.keep_pages, self.device = sinks, page, quantized, keep_pages, device
        self.lengths: list[int] = []  # real tokens per row in the far tier (sinks included)
        self.sink: dict[str, torch.Tensor] = {}  # keys, values [B, H, S, D]; positions [B, S]
        self.store: dict[str, torch.Tensor] = {}  # keys, values (+ scales) [B, H, cap, D]; positions [B, cap]
        self.page_min: torch.Tensor | None = None  # [B, H, P_cap, D] float32, keys as attention sees them
        self.page_max: torch.Tensor | None = None
        self.summary_groups: list[int] | None = None  # Self-Extend groups the summaries were computed with
        self.clean_pages = 0  # summaries of pages < clean_pages are current

    def paged_lengths(self) -> list[int]:
        return [max(0, n - self.sinks) for n in self.lengths]

    def page_count(self) -> int:
        return -(-max(self.paged_lengths(), default=0) // self.page)

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, first_slot: int,
            pad: list[int]) -> None:
        """Store a block of consecutive slots ``first_slot ..`` (``keys, values: [B, H, n, D]``)."""
        n = keys.shape[2]
        if not self.lengths:
            self.lengths = [0] * keys.shape[0]
        starts = [first_slot - p for p in pad]  # real index of the block's first token, per row
        start = torch.tensor(starts, device=keys.device).view(-1, 1)
        if self.sinks and min(starts) < self.sinks:
            if not self.sink:
                self.sink = {"keys": keys.new_zeros(*keys.shape[:2], self.sinks, keys.shape[3]),
                             "values": values.new_zeros(*values.shape[:2], self.sinks, values.shape[3]),
                             "positions": positions.new_zeros(keys.shape[0], self.sinks)}
            source = torch.arange(self.sinks, device=keys.device).view(1, -1) - start
            for name, block in (("keys", keys), ("values", values), ("positions", positions)):
                _write_range(self.sink[name], 2 if name != "positions" else 1, 0, block, source)
        low, high = max(0, min(starts) - self.sinks), max(0, max(starts) + n - self.sinks)
        if self.keep_pages and high > low:
            self._reserve(high, keys, values)
            source = (torch.arange(low, high, device=keys.device).view(1, -1) + self.sinks - start).to(self.device)
            uniform = low + self.sinks - starts[0] if len(set(starts)) == 1 else None
            blocks: dict[str, torch.Tensor] = {"positions": positions.to(torch.int32)}
            if self.quantized:
                (blocks["keys"], blocks["key_scales"]), (blocks["values"], blocks["value_scales"]) = (
                    quantize_int8(keys), quantize_int8(values))
            else:
                blocks["keys"], blocks["values"] = keys, values
            for name, block in blocks.items():
                _write_range(self.store[name], 2 if name != "positions" else 1, low, block.to(self.device), source,
                             uniform)
            self.clean_pages = min(self.clean_pages, low // self.page)
        self.lengths = [max(length, s + n) for length, s in zip(self.lengths, starts, strict=True)]

    def _reserve(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Capacity for ``needed`` paged entries (whole pages); grows by at least 1/GROWTH."""
        capacity = self.store["positions"].shape[1] if self.store else 0
        if needed <= capacity:
            return
        grown = needed if not self.store else needed + max(self.page, needed // GROWTH)
        grown = -(-grown // self.page) * self.page
        b, h = keys.shape[:2]
        fresh = {"positions": torch.zeros(b, grown, dtype=torch.int32, device=self.device)}
        if self.quantized:
            for name, like in (("keys", keys), ("values", values)):
                fresh[name] = torch.zeros(b, h, grown, like.shape[3], dtype=torch.int8, device=self.device)
                fresh[name[:-1] + "_scales"] = torch.ones(b, h, grown, 1, dtype=torch.float32, device=self.device)
        else:
            fresh["keys"] = keys.new_zeros(b, h, grown, keys.shape[3], device=self.device)
            fresh["values"] = values.new_zeros(b, h, grown, values.shape[3], device=self.device)
        for name, old in self.store.items():
            fresh[name].narrow(-1 if name == "positions" else 2, 0, capacity).copy_(old)
        self.store = fresh

    def pages_of(self, pages: torch.Tensor, dtype: torch.dtype, device: torch.device,
                 with_positions: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Whole pages ``pages: [B, H, k]`` -> ``keys, values: [B, H, k·page, D]`` (``dtype``), ``positions
        [B, H, k·page]`` (``None`` unless ``with_positions``): one row copy per page (the store is contiguous
        and whole pages long)."""
        pages = pages.to(self.device)
        b, h, k = pages.shape
        count = self.store["positions"].shape[1] // self.page
        head = torch.arange(b * h, device=self.device).view(b, h, 1)
        flat = (head * count + pages).flatten()

        def take(name: str) -> torch.Tensor:
            part = self.store[name]
            return part.view(b * h * count, -1).index_select(0, flat).view(b, h, k * self.page, -1).to(device)

        positions = None
        if with_positions:
            rows = (torch.arange(b, device=self.device).view(b, 1, 1) * count + pages).flatten()
            positions = self.store["positions"].view(b * count, self.page).index_select(0, rows)
            positions = positions.view(b, h, k * self.page).to(device, torch.int64)
        if self.quantized:
            return (dequantize_int8(take("keys"), take("key_scales"), dtype),
                    dequantize_int8(take("values"), take("value_scales"), dtype), positions)
        return take("keys").to(dtype), take("values").to(dtype), positions  # .to is a no-op at the same dtype

    def page_range(self, first: int, last: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, H, (last-first)*page, D]`` and positions ``[B, (last-first)*page]`` of pages ``first..last-1``."""
        low, width = first * self.page, (last - first) * self.page
        keys = self.store["keys"].narrow(2, low, width).to(device)
        if self.quantized:
            keys = dequantize_int8(keys, self.store["key_scales"].narrow(2, low, width).to(device), dtype)
        return keys.to(dtype), self.store["positions"].narrow(1, low, width).to(device, torch.int64)

    def map_keys(self, fn: Any, device: torch.device) -> None:
        """Replace every held key ``k`` (sinks and pages) by ``fn(k, positions)`` in place, computed on ``device``
        in blocks of pages."""
        if self.sink:
            keys = self.sink["keys"]
            keys.copy_(fn(keys.to(device), self.sink["positions"].to(device, torch.int64)).to(keys.device))
        if not self.store:
            return
        b, h, capacity, d = self.store["keys"].shape
        step = max(self.page, CHUNK_ELEMENTS // max(1, b * h * d) // self.page * self.page)
        for low in range(0, capacity, step):
            width = min(step, capacity - low)
            positions = self.store["positions"].narrow(1, low, width).to(device, torch.int64)
            keys = self.store["keys"].narrow(2, low, width)
            if self.quantized:
                scales = self.store["key_scales"].narrow(2, low, width)
                codes, new_scales = quantize_int8(fn(dequantize_int8(keys.to(device), scales.to(device),
                                                                     torch.float32), positions))
                keys.copy_(codes.to(keys.device))
                scales.copy_(new_scales.to(scales.device))
            else:
                keys.copy_(fn(keys.to(device), positions).to(keys.device))

    def select_rows(self, rows: torch.Tensor) -> None:
        order = rows.tolist()
        self.lengths = [self.lengths[i] for i in order] if self.lengths else []
        if self.summary_groups is not None:
            self.summary_groups = [self.summary_groups[i] for i in order]
        for store in (self.sink, self.store):
            for name, value in store.items():
                store[name] = value.index_select(0, rows.to(value.device))
        if self.page_min is not None and self.page_max is not None:
            self.page_min = self.page_min.index_select(0, rows.to(self.page_min.device))
            self.page_max = self.page_max.index_select(0, rows.to(self.page_max.device))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.sink.values(), *self.store.values(),
                *(t for t in (self.page_min, self.page_max) if t is not None)]

    def nbytes(self) -> int:
        return tensors_nbytes(self.tensors())


_Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # keys, values, positions, slots


@dataclasses.dataclass
class _Step:
    """What every layer needs about one forward call's positions (computed once, shared by the layers)."""

    positions: torch.Tensor  # [B, q] int64
    row_lengths: list[int]  # per row: largest position + 1
    aligned: bool  # every row's positions are its slots (no padding, no offset)


# ----------------------------------------------------------------------------------------------- the layer


class DKCacheLayer(CompressedLayer):
    """Core / steady / far tiers of one decoder layer (see the module docstring)."""

    def __init__(self, cache: KVCache, layer_idx: int, method: DKCache) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        self.trained = method.trained_length or int(cache.config.max_position_embeddings)
        self.core_size, self.steady_bound = method.bounds(self.trained)
        self.alpha = method.effective_alpha if method.decouple else 0.0
        self.pre_rope = method.key_storage == "pre_rope"
        self.table: RopeTable | None = None
        self.position_limit = 0  # largest position held + 1 (the RoPE table covers it)
        self.rotated = True  # held keys are post-RoPE (always with post_rope storage; pre_rope: until compensating)
        self.aligned = True  # every held token's position is its slot
        # while compensating on the fast path: steady and far keys (sinks, pages) are held rotated at positions
        # p // held_group (the core stays pre-RoPE); None: every tier is held as ``rotated`` says
        self.held_group: int | None = None
        if self.pre_rope:
            key = f"dkcache.rope.{cache.layer_types[layer_idx]}"
            if key not in cache.shared:
                cache.shared[key] = RopeTable(cache.rotary_for(layer_idx))
            self.table = cache.shared[key]
        self.pad: list[int] = []
        self.core_tier = _Tier(quantized=False)
        self.steady_tier = _Tier(quantized=method.bits == 8)
        self.far: _FarTier | None = None
        self.steady_sum: torch.Tensor | None = None  # [B, H, 1, D] float64, running sum of real steady keys
        self.steady_count: torch.Tensor | None = None  # [B] float64
        self.groups: list[int] = []  # Self-Extend group per row at the last step
        self.last_entropy: torch.Tensor | None = None  # [B] normalised attention entropy of the last step
        self.last_attended: torch.Tensor | None = None  # [B] entries the last query attended (mean over heads)
        self.pages_last: torch.Tensor | None = None  # [B, H] far pages retrieved at the last step
        self.pages_total: torch.Tensor | None = None  # [B, H] summed over decode steps
        self.decode_steps = 0
        self.retrieval_steps = 0

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx, self.method)  # type: ignore[misc]

    # -- positions
    def _step(self, position_ids: torch.Tensor | None, first: int, q_len: int, device: torch.device) -> _Step:
        """Positions of this forward call, shared by all layers (one host sync per call, not per layer)."""
        cached = self.cache.shared.get("dkcache.step")
        key = (first, q_len, self.rows)
        if cached is not None and cached[0] is position_ids and cached[1] == key:
            return cached[2]  # type: ignore[no-any-return]
        if position_ids is None:
            positions = torch.arange(first, first + q_len, device=device).view(1, -1)
        else:
            positions = position_ids.to(device, torch.int64)
        positions = positions.expand(self.rows, -1)
        slots = torch.arange(first, first + q_len, device=device).view(1, -1)
        lengths, aligned = torch.stack([positions.amax(-1) + 1, (positions == slots).all(-1).long()]).tolist()
        step = _Step(positions, [int(n) for n in lengths], all(aligned))
        self.cache.shared["dkcache.step"] = (position_ids, key, step)
        return step

    def _group_sizes(self, step: _Step) -> list[int]:
        if not self.method.remaps_positions:
            return [1] * self.rows
        return [group_size(length, self.core_size, self.trained) for length in step.row_lengths]

    def _rotate_keys(self, keys: torch.Tensor, positions: torch.Tensor,
                     groups: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored keys -> (exact, grouped) keys as attention sees them; ``positions: [B, 1 or H, T]``.
        Without compensation (keys held post-RoPE) the grouped keys are the exact ones."""
        if self.table is None or self.rotated:
            return keys, keys
        exact = self.table.rotate(keys, positions)
        grouped = exact if groups is None else self.table.rotate(keys, positions // groups.view(-1, 1, 1))
        return exact, grouped

    def _grouped_query(self, query: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        assert self.table is not None
        pre = self.table.unrotate(query, positions)
        return self.table.rotate(pre, grouped_query_positions(positions, groups, self.core_size))

    # -- the attention step
    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        """Store the new tokens in the core, attend (exact at prefill, over the tiers when decoding), re-tier.

        ``query: [B, Hq, q, D]``, ``key, value: [B, H, q, D]`` (post-RoPE) -> ``[B, q, Hq, D]``.
        """
        q_len, first = key.shape[2], self.seen
        step = self._step(kwargs.get("position_ids"), first, q_len, key.device)
        if first == 0:
            self._start(attention_mask, q_len)
        self.groups = self._group_sizes(step)
        grouped = max(self.groups) > 1
        groups = torch.tensor(self.groups, device=key.device) if grouped else None
        scaling = kwargs.get("scaling") or key.shape[-1] ** -0.5
        if self.table is not None:
            self.position_limit = max(self.position_limit, *step.row_lengths)
            self.table.ensure(self.position_limit, key.device)
        if first == 0:
            self.rotated, self.aligned = self.table is None or (HOLD_ROTATED and not grouped), max(self.pad) == 0
        elif grouped and self.rotated:
            self._unrotate_held()
        self.aligned = self.aligned and step.aligned
        stored = key if self.rotated else self.table.unrotate(key, step.positions)  # type: ignore[union-attr]
        self.seen += q_len
        self.core_tier.append(stored, value, step.positions)
        if first == 0:
            out = self._prefill_attention(module, query, key, value, stored, attention_mask, step, groups,
                                          scaling, kwargs)
        elif FAST_DECODE and groups is None and self.rotated:
            out = self._exact_attention(query, attention_mask, scaling, first, q_len)
        elif (FAST_COMPENSATED and groups is not None and self.aligned and len(set(self.groups)) == 1
              and first >= self.trained and self.table is not None):
            out = self._compensated_attention(query, attention_mask, step, groups, scaling, first, q_len)
        else:
            if self.held_group is not None:
                self._hold_grouped(None)
            out = self._tiered_attention(query, attention_mask, step, groups, scaling, first, q_len)
        self._retier()
        return out

    def _start(self, attention_mask: torch.Tensor | None, q_len: int) -> None:
        """Prefill: left padding per row and, with ``ratio``, the tier bounds from the prompt length."""
        mask = mask_to_bool(attention_mask)
        self.pad = [0] * self.rows if mask is None else (~mask[:, 0, -1, :q_len]).sum(-1).tolist()
        self.pad_count = torch.tensor(self.pad, device=self.device)
        if self.method.ratio is not None:  # one set of bounds for the batch: from its longest row
            core, steady = self.method.bounds(self.trained)
            budget = max(1, int(self.method.ratio * (q_len - min(self.pad))) - self.method.sinks)
            self.steady_bound = budget
            self.core_size = min(budget, max(1, round(budget * core / steady)))

    def _prefill_attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, stored: torch.Tensor, attention_mask: torch.Tensor | None,
                           step: _Step, groups: torch.Tensor | None, scaling: float,
                           kwargs: dict[str, Any]) -> torch.Tensor:
        """Exact attention over the prompt; beyond the trained range at compensated positions (in query chunks)."""
        if groups is None:
            out, _ = sdpa_attention(module, query, key, value, attention_mask, **kwargs)
            if self.method.retrieve == "entropy":  # the first decode step reads the prompt's last query
                last = self._prefill_visible(attention_mask, key.shape[2], key.shape[2] - 1, key.shape[2])
                _, self.last_entropy = remapped_attention(query[:, :, -1:], None, key, None, value, last, None,
                                                          scaling)
            return out
        positions = step.positions
        slots = torch.arange(positions.shape[1], device=self.device).view(1, -1)
        pad = self.pad_count.view(-1, 1)  # type: ignore[union-attr]
        contiguous = bool(((positions == slots - pad) | (slots < pad)).all())  # real tokens at slot - pad
        key_grouped = self.table.rotate(stored, positions // groups.view(-1, 1)) if self.table else None
        query_grouped = self._grouped_query(query, positions, groups)
        b, hq, n, _ = query.shape
        if FAST_PREFILL and key_grouped is not None and contiguous and max(self.pad) == 0:
            fast = flash_remapped_prefill(query, query_grouped, key, key_grouped, value, self.core_size,
                                          self.trained, scaling, FLASH_CHUNK)
            if fast is not None:
                last = self._prefill_visible(attention_mask, n, n - 1, n)
                near = is_near(positions[:, -1:].unsqueeze(-1), positions.unsqueeze(1), self.core_size,
                               self.trained).unsqueeze(1)
                _, self.last_entropy = remapped_attention(query[:, :, -1:], query_grouped[:, :, -1:], key,
                                                          key_grouped, value, last, near, scaling)
                return fast
        chunk = max(1, CHUNK_ELEMENTS // max(1, 2 * b * hq * n))
        outputs = []
        for low in range(0, n, chunk):
            high = min(n, low + chunk)
            visible = self._prefill_visible(attention_mask, n, low, high)[..., :high]
            near = is_near(positions[:, low:high].unsqueeze(-1), positions[:, :high].unsqueeze(1), self.core_size,
                           self.trained).unsqueeze(1)
            # keys before low - core + 1 are far from every query of the chunk (positions grow with slots)
            banded = contiguous and bool((positions[:, low:high] >= self.trained).all())
            out, self.last_entropy = remapped_attention(
                query[:, :, low:high], query_grouped[:, :, low:high], key[:, :, :high], key_grouped[:, :, :high]
                if key_grouped is not None else None, value[:, :, :high], visible, near, scaling,
                exact_from=max(0, low - self.core_size + 1) if banded else 0)
            outputs.append(out)
        return torch.cat(outputs, dim=1)

    def _prefill_visible(self, attention_mask: torch.Tensor | None, n: int, low: int, high: int) -> torch.Tensor:
        """``[B, 1, high-low, n]`` bool: which prompt tokens queries ``low..high-1`` may see."""
        mask = mask_to_bool(attention_mask)
        if mask is not None:
            return mask[:, :, low:high, :n].expand(self.rows, -1, -1, -1)
        queries = torch.arange(low, high, device=self.device).view(-1, 1)
        return (torch.arange(n, device=self.device).view(1, -1) <= queries).view(1, 1, high - low, n)

    def _tiered_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, step: _Step,
                          groups: torch.Tensor | None, scaling: float, first: int, q_len: int) -> torch.Tensor:
        """Decode: attention over sinks + retrieved far pages + steady (decoupled) + core (incl. the new tokens)."""
        dtype = query.dtype
        query_grouped = self._grouped_query(query, step.positions, groups) if groups is not None else None
        parts: list[_Part] = []
        for tier, decoupled in ((self.steady_tier, self.alpha > 0), (self.core_tier, False)):
            if len(tier):
                keys, values, positions = tier.read(dtype)
                mean = self.steady_mean() if decoupled else None
                if mean is not None and self.rotated and self.table is not None:  # R(p)(k - a m) = R(p)k - a R(p)m
                    keys = keys - self.alpha * self.table.rotate(mean.to(keys.dtype).expand_as(keys), positions)
                elif mean is not None:
                    keys = decouple_keys(keys, mean, self.alpha)
                slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
                parts.append((keys, values, positions.unsqueeze(1), slots.view(1, 1, -1).expand(self.rows, 1, -1)))
        valid: list[torch.Tensor] = [torch.ones(self.rows, 1, p[0].shape[2], dtype=torch.bool, device=self.device)
                                     for p in parts]
        if self.far is not None:
            for part, ok in self._far_parts(query if query_grouped is None else query_grouped, dtype):
                parts.insert(0, part)
                valid.insert(0, ok)
        h = parts[-1][0].shape[1]  # KV heads
        rotated = [self._rotate_keys(p[0], p[2], groups) for p in parts]  # per part: cos/sin shared by heads
        keys_exact = torch.cat([k.expand(-1, h, -1, -1) for k, _ in rotated], dim=2)
        keys_grouped = None if groups is None else torch.cat([g.expand(-1, h, -1, -1) for _, g in rotated], dim=2)
        values = torch.cat([p[1].expand(-1, h, -1, -1) for p in parts], dim=2)
        positions = torch.cat([p[2].expand(self.rows, h, -1) for p in parts], dim=2)
        slots = torch.cat([p[3].expand(self.rows, h, -1) for p in parts], dim=2)
        ok = torch.cat([v.expand(self.rows, h, -1) for v in valid], dim=2)
        slots = slots.clamp(0, first + q_len - 1)
        visible = visible_mask(attention_mask, slots.to(torch.int32), first, q_len) & ok.unsqueeze(2)
        near = None
        if groups is not None:
            near = is_near(step.positions.view(self.rows, 1, q_len, 1), positions.unsqueeze(2), self.core_size,
                           self.trained)
        out, self.last_entropy = remapped_attention(query, query_grouped, keys_exact, keys_grouped, values,
                                                    visible, near, scaling)
        self.last_attended = visible[:, :, -1, :].sum(-1).float().mean(1)
        self.decode_steps += 1
        return out

    def _exact_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                         first: int, q_len: int) -> torch.Tensor:
        """Decode at exact positions with keys held as attention sees them: the same attention as
        :meth:`_tiered_attention` (sinks + retrieved pages + decoupled steady + core), computed as logits per
        tier and one softmax over their concatenation, so no key or value is copied, concatenated or rotated.
        The steady tier's decoupling enters as a logit bias."""
        dtype = query.dtype
        b, hq, n, d = query.shape
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        if self.far is not None:  # keys, values, slots, validity, bias
            parts += [(p[0], p[1], p[3], ok, None) for p, ok in self._far_parts(query, dtype, False)]
        for tier, decoupled in ((self.steady_tier, self.alpha > 0), (self.core_tier, False)):
            if len(tier):
                keys, values, positions = tier.read(dtype)
                slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
                bias = self._decoupling_bias(query, positions, tier.first_slot) if decoupled else None
                parts.append((keys, values, slots.view(1, 1, -1).expand(self.rows, 1, -1), None, bias))
        h = parts[-1][0].shape[1]
        q = query.reshape(b, h, hq // h * n, d)
        scored = []
        for keys, values, slots, ok, bias in parts:
            logits = q @ keys.to(q.dtype).transpose(-1, -2)
            scored.append((logits if bias is None else logits + bias, values, slots, ok))
        return self._attend_parts(scored, query.shape, attention_mask, scaling, first, q_len)

    def _attend_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                      shape: torch.Size, attention_mask: torch.Tensor | None, scaling: float, first: int,
                      q_len: int) -> torch.Tensor:
        """One softmax over the concatenated logits of attention parts ``(logits [B, H, groups·n, T_i], values
        [B, H, T_i, D], slots [B, 1 or H, T_i], validity [B, H, T_i] or None)``, the output summed per part."""
        b, hq, n, _ = shape
        h = parts[-1][1].shape[1]
        g = hq // h
        seen = []
        for _, _, slots, ok in parts:
            visible = visible_mask(attention_mask, slots.clamp(0, first + q_len - 1).to(torch.int32), first, q_len)
            seen.append((visible if ok is None else visible & ok.unsqueeze(2)).expand(b, h, n, -1))
        visible = torch.cat(seen, dim=-1)
        scores = torch.cat([p[0] for p in parts], dim=-1).view(b, h, g, n, -1)
        probs, self.last_entropy = attention_probs(scores, visible, scaling)
        out, low = None, 0
        for _, values, *_ in parts:
            width = values.shape[2]
            term = probs[..., low:low + width].to(values.dtype).reshape(b, h, g * n, width) @ values
            out, low = term if out is None else out + term, low + width
        assert out is not None
        self.last_attended = visible[:, :, -1, :].sum(-1).float().mean(1)
        self.decode_steps += 1
        return out.view(b, hq, n, -1).transpose(1, 2).contiguous()

    def _compensated_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, step: _Step,
                               groups: torch.Tensor, scaling: float, first: int, q_len: int) -> torch.Tensor:
        """Decode beyond the trained range, every position its slot: the same attention as
        :meth:`_tiered_attention`, computed per tier. Steady and far keys are held rotated at their grouped
        positions ``p // G`` (re-rotated only when ``G`` grows), so they only meet the grouped query; every
        steady and far key is at least ``core`` tokens from the query (the core tier holds the newest ``core``),
        hence never a neighbour. The (small) core tier is rotated at exact and grouped positions each step and
        its neighbours take the exact logits. The steady decoupling enters as a logit bias at grouped positions."""
        table = self.table
        assert table is not None
        group = self.groups[0]
        if self.held_group != group:
            self._hold_grouped(group)
        dtype = query.dtype
        b, hq, n, d = query.shape
        query_grouped = self._grouped_query(query, step.positions, groups)
        h = self.core_tier.parts["keys"].view().shape[1]
        q, qg = query.reshape(b, h, hq // h * n, d), query_grouped.reshape(b, h, hq // h * n, d)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if self.far is not None:
            for (keys, values, _, slots), ok in self._far_parts(query_grouped, dtype, False):
                parts.append((qg @ keys.to(qg.dtype).transpose(-1, -2), values, slots, ok))
        for tier in (self.steady_tier, self.core_tier):
            if not len(tier):
                continue
            keys, values, positions = tier.read(dtype)
            slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=self.device)
            if tier is self.steady_tier:
                logits = qg @ keys.to(qg.dtype).transpose(-1, -2)
                if self.alpha > 0:
                    bias = self._grouped_decoupling_bias(query_grouped, tier.first_slot, len(tier), group)
                    logits = logits if bias is None else logits + bias
            else:
                queries = torch.arange(first, first + q_len, device=self.device).view(-1, 1)
                near = is_near(queries, slots.view(1, -1), self.core_size)  # [n, T] (positions are slots)
                exact = q @ table.rotate(keys, positions).to(q.dtype).transpose(-1, -2)
                far_logits = qg @ table.rotate(keys, positions // group).to(qg.dtype).transpose(-1, -2)
                logits = torch.where(near.repeat(hq // h, 1), exact, far_logits)
            parts.append((logits, values, slots.view(1, 1, -1).expand(self.rows, 1, -1), None))
        return self._attend_parts(parts, query.shape, attention_mask, scaling, first, q_len)

    def _grouped_decoupling_bias(self, query_grouped: torch.Tensor, first_slot: int, length: int,
                                 group: int) -> torch.Tensor | None:
        """``[B, H, groups·n, T]``: the steady logits' decoupling shift ``−α·q·R(p_j // G)·m`` for the steady
        tier's slots ``first_slot ..`` (positions are slots), computed once per distinct grouped position."""
        mean = self.steady_mean()
        if mean is None or self.table is None:
            return None
        b, hq, n, d = query_grouped.shape
        h = mean.shape[1]
        q = query_grouped.reshape(b, h, hq // h * n, d)
        m = mean.to(q.dtype)
        low, high = first_slot // group, (first_slot + length - 1) // group + 1
        cos, sin = (t[low:high].to(q.dtype) for t in self.table.tables[query_grouped.device])
        distinct = -self.alpha * ((q * m) @ cos.transpose(-1, -2) + (q * rotate_half(m)) @ sin.transpose(-1, -2))
        index = torch.arange(first_slot, first_slot + length, device=self.device) // group - low
        return distinct.index_select(-1, index)

    def _hold_grouped(self, group: int | None) -> None:
        """Re-rotate the steady and far keys (sinks and pages) from how they are held to positions ``p // group``
        (``None``: back to pre-RoPE, every tier then held as ``rotated`` says). Held keys must be pre-RoPE or
        grouped; one pass over them (INT8 entries are dequantized and requantized)."""
        table, old = self.table, self.held_group
        assert table is not None and not self.rotated
        if old == group:
            return

        def regroup(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            keys = keys if old is None else table.unrotate(keys, positions // old)
            return keys if group is None else table.rotate(keys, positions // group)

        self.steady_tier.map_keys(regroup)
        if self.far is not None:
            self.far.map_keys(regroup, self.device)
            self.far.clean_pages = 0
        self.held_group = group

    def _decoupling_bias(self, query: torch.Tensor, positions: torch.Tensor, first_slot: int) -> torch.Tensor | None:
        """``[B, H, groups·n, T]`` (or ``T = 1`` broadcast): the steady logits' decoupling shift ``−α·q·k_shift`` for
        keys held post-RoPE. Pre-RoPE decoupling shifts key ``j`` by ``R(p_j)·m``, so the bias is
        ``−α·(cos(p_j)·(q∘m) + sin(p_j)·(q∘rot(m)))``; post-RoPE decoupling shifts every key by ``m``."""
        mean = self.steady_mean()
        if mean is None:
            return None
        b, hq, n, d = query.shape
        h = mean.shape[1]
        q = query.reshape(b, h, hq // h * n, d)
        m = mean.to(q.dtype)
        if self.table is None:
            return -self.alpha * (q @ m.transpose(-1, -2))
        cos, sin = self.table.tables[query.device]
        if self.aligned:  # positions are the slots: a slice of the table, [T, D]
            cos, sin = (t[first_slot:first_slot + positions.shape[-1]] for t in (cos, sin))
        else:  # [B, 1, T, D]
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return -self.alpha * ((q * m) @ cos.transpose(-1, -2) + (q * rotate_half(m)) @ sin.transpose(-1, -2))

    def _unrotate_held(self) -> None:
        """The context just outgrew the trained range: from now on keys are held pre-RoPE, so they can be rotated
        at remapped positions. One pass over every held key (INT8 entries are dequantized and requantized); the
        decoupling mean is already pre-RoPE; far-page summaries are recomputed at the new positions."""
        table = self.table
        assert table is not None
        for tier in (self.core_tier, self.steady_tier):
            tier.map_keys(table.unrotate)
        if self.far is not None:
            self.far.map_keys(table.unrotate, self.device)
            self.far.clean_pages = 0
        self.rotated = False

    def _far_parts(self, query: torch.Tensor, dtype: torch.dtype,
                   with_positions: bool = True) -> list[tuple[_Part, torch.Tensor]]:
        """Sinks and the retrieved far pages as attention parts (keys, values, positions, slots) + validity."""
        assert self.far is not None
        far, parts = self.far, list[tuple[_Part, torch.Tensor]]()
        pad = self.pad_count.view(-1, 1, 1) if self.pad_count is not None else 0
        if far.sink:
            count = torch.tensor([min(far.sinks, n) for n in far.lengths], device=self.device)
            index = torch.arange(far.sinks, device=self.device).view(1, 1, -1)
            parts.append(((far.sink["keys"].to(dtype), far.sink["values"].to(dtype),
                           far.sink["positions"].unsqueeze(1).to(torch.int64), pad + index),
                          index < count.view(-1, 1, 1)))
        self.pages_last = None
        if far.keep_pages and far.page_count():
            retrieved = self._retrieve(query, dtype, with_positions)
            if retrieved is not None:
                parts.append(retrieved)
        return parts

    def _retrieve(self, query: torch.Tensor, dtype: torch.dtype,
                  with_positions: bool = True) -> tuple[_Part, torch.Tensor] | None:
        """The top ``pages`` far pages per (row, KV head) by the upper bound of ``q·k`` (their positions only
        ``with_positions``: the paths that hold keys as attention sees them do not read them)."""
        assert self.far is not None
        far = self.far
        rows_on = torch.ones(self.rows, dtype=torch.bool, device=self.device)
        if self.method.retrieve == "entropy" and self.last_entropy is not None:
            rows_on = self.last_entropy > self.method.entropy_threshold
            if not bool(rows_on.any()):
                return None
        self._refresh_summaries(dtype)
        assert far.page_min is not None and far.page_max is not None
        count = far.page_count()
        b, hq, n, d = query.shape
        h = far.page_min.shape[1]
        bounds = page_upper_bounds(query.reshape(b, h, hq // h * n, d), far.page_min[:, :, :count],
                                   far.page_max[:, :, :count]).amax(2)  # [B, H, P]
        lengths = far.paged_lengths()
        if len(set(lengths)) == 1:  # rows hold the same far tokens (no padding): every page < count is real
            paged: torch.Tensor | int = lengths[0]
            top = bounds.topk(min(self.method.pages, count), dim=-1)
            chosen = rows_on.view(-1, 1, 1).expand(b, h, top.indices.shape[-1])
        else:
            paged = torch.tensor(lengths, device=self.device).view(-1, 1, 1)
            page_ok = torch.arange(count, device=self.device).view(1, 1, -1) * far.page < paged
            top = bounds.masked_fill(~page_ok, float("-inf")).topk(min(self.method.pages, count), dim=-1)
            chosen = page_ok.expand(b, h, -1).gather(2, top.indices) & rows_on.view(-1, 1, 1)
        self.pages_last = chosen.sum(-1)
        self.pages_total = self.pages_last if self.pages_total is None else self.pages_total + self.pages_last
        self.retrieval_steps += 1
        index = (top.indices.unsqueeze(-1) * far.page + torch.arange(far.page, device=self.device)).flatten(2)
        keys, values, positions = far.pages_of(top.indices, dtype, self.device, with_positions)
        ok = (index < paged) & chosen.repeat_interleave(far.page, dim=2)
        slots = self.pad_count.view(-1, 1, 1) + far.sinks + index if self.pad_count is not None else index
        return (keys, values, positions, slots), ok  # type: ignore[return-value]

    def _refresh_summaries(self, dtype: torch.dtype) -> None:
        """Per-channel min/max of each page's keys as attention sees them (rotated at the grouped positions the
        current step uses); only pages that changed, or all when a row's Self-Extend group changed."""
        assert self.far is not None
        far = self.far
        count = far.page_count()
        if far.summary_groups != self.groups:
            far.clean_pages, far.summary_groups = 0, list(self.groups)
        if far.clean_pages >= count:
            return
        b, h, d = self.rows, far.store["keys"].shape[1], far.store["keys"].shape[3]
        capacity = far.store["positions"].shape[1] // far.page
        if far.page_min is None or far.page_min.shape[2] < capacity:
            fresh = [torch.zeros(b, h, capacity, d, device=self.device) for _ in range(2)]
            if far.page_min is not None and far.page_max is not None:
                fresh[0][:, :, : far.page_min.shape[2]] = far.page_min
                fresh[1][:, :, : far.page_max.shape[2]] = far.page_max
            far.page_min, far.page_max = fresh
        page_min, page_max = far.page_min, far.page_max
        assert page_min is not None and page_max is not None
        groups = torch.tensor(self.groups, device=self.device).view(-1, 1, 1)
        lengths = far.paged_lengths()
        paged = torch.tensor(lengths, device=self.device).view(-1, 1, 1, 1)
        step = max(1, CHUNK_ELEMENTS // max(1, b * h * far.page * d))
        for low in range(far.clean_pages, count, step):
            high = min(count, low + step)
            keys, positions = far.page_range(low, high, dtype, self.device)
            if self.table is not None and not self.rotated and self.held_group is None:
                keys = self.table.rotate(keys, positions.unsqueeze(1) // groups)
            keys = keys.float().reshape(b, h, high - low, far.page, d)
            if len(set(lengths)) == 1:  # the same far tokens in every row: only the last page is partial
                whole = max(0, min(high, lengths[0] // far.page) - low)
                if whole:
                    page_min[:, :, low:low + whole] = keys[:, :, :whole].amin(3)
                    page_max[:, :, low:low + whole] = keys[:, :, :whole].amax(3)
                if low + whole < high:
                    rest = keys[:, :, whole, : lengths[0] - (low + whole) * far.page]
                    page_min[:, :, low + whole] = rest.amin(2)
                    page_max[:, :, low + whole] = rest.amax(2)
                continue
            index = torch.arange(low * far.page, high * far.page, device=self.device).view(1, 1, -1, 1)
            ok = (index < paged).view(b, 1, high - low, far.page, 1)
            any_ok = ok.any(3)
            page_min[:, :, low:high] = keys.masked_fill(~ok, float("inf")).amin(3).masked_fill(~any_ok, 0)
            page_max[:, :, low:high] = keys.masked_fill(~ok, float("-inf")).amax(3).masked_fill(~any_ok, 0)
        far.clean_pages = count

    # -- moving tokens between tiers
    def _retier(self) -> None:
        """core -> steady -> far, by recency (token index), the same boundaries for every row."""
        dtype = self.dtype
        overflow = len(self.core_tier) - self.core_size
        if overflow > 0:
            slot = self.core_tier.first_slot
            keys, values, positions = self.core_tier.pop_front(overflow, dtype)
            if self.held_group is not None:  # the core is pre-RoPE, steady keys are held at grouped positions
                keys = self.table.rotate(keys, positions // self.held_group)  # type: ignore[union-attr]
            self.steady_tier.first_slot = slot if not len(self.steady_tier) else self.steady_tier.first_slot
            stored = self.steady_tier.append(keys, values, positions)
            self._update_mean(stored, positions, slot, +1)
        overflow = len(self.steady_tier) - (self.steady_bound - self.core_size)
        if overflow > 0:
            slot = self.steady_tier.first_slot
            keys, values, positions = self.steady_tier.pop_front(overflow, dtype)
            self._update_mean(keys, positions, slot, -1)
            if self.far is None:
                self.far = _FarTier(self.method.sinks, self.method.page,
                                    quantized=self.method.bits == 8 or self.method.far_dtype == "int8",
                                    keep_pages=self.method.retrieve != "never",
                                    device=far_device(self.device, self.method.offload))
            self.far.add(keys, values, positions, slot, self.pad)
        if not len(self.steady_tier):
            self.steady_tier.first_slot = self.core_tier.first_slot
        self.core_tier.fit()
        self.steady_tier.fit()

    def _update_mean(self, keys: torch.Tensor, positions: torch.Tensor, first_slot: int, sign: int) -> None:
        """Running sum / count of the steady tier's real keys (padding excluded), per (row, head); pre-RoPE with
        ``key_storage="pre_rope"`` (held keys are de-rotated for it while they are held post-RoPE)."""
        if self.alpha <= 0:
            return
        if self.held_group is not None and self.table is not None:
            keys = self.table.unrotate(keys, positions // self.held_group)
        elif self.rotated and self.table is not None:
            keys = self.table.unrotate(keys, positions)
        slots = torch.arange(first_slot, first_slot + keys.shape[2], device=self.device).view(1, -1)
        real = (slots >= self.pad_count.view(-1, 1)).double()  # type: ignore[union-attr]
        total = (keys.double() * real.view(real.shape[0], 1, -1, 1)).sum(2, keepdim=True)
        if self.steady_sum is None or self.steady_count is None:
            self.steady_sum, self.steady_count = torch.zeros_like(total), torch.zeros_like(real[:, 0])
        self.steady_sum += sign * total
        self.steady_count += sign * real.sum(-1)

    def steady_mean(self) -> torch.Tensor | None:
        """``[B, H, 1, D]`` the decoupling mean in use (pre-RoPE with pre_rope storage, else post-RoPE), ``None``
        before the tier fills."""
        if self.steady_sum is None or self.steady_count is None:
            return None
        return self.steady_sum / self.steady_count.clamp(min=1).view(-1, 1, 1, 1)

    # -- batch, bytes, stats
    def select_rows(self, rows: torch.Tensor) -> None:
        order = rows.tolist()
        for tier in (self.core_tier, self.steady_tier):
            tier.select_rows(rows)
        if self.far is not None:
            self.far.select_rows(rows)
        self.pad = [self.pad[i] for i in order] if self.pad else []
        self.groups = [self.groups[i] for i in order] if self.groups else []
        for name in ("steady_sum", "steady_count", "last_entropy", "last_attended", "pages_last", "pages_total",
                     "pad_count"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, rows.to(value.device)))
        self.rows = len(order)

    def _tier_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"core": self.core_tier.tensors(), "steady": self.steady_tier.tensors(),
                "far": self.far.tensors() if self.far is not None else [],
                "other": [t for t in (self.steady_sum, self.steady_count, self.last_entropy, self.last_attended,
                                      self.pages_last, self.pages_total, self.pad_count) if t is not None]}

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (all tiers, page summaries, running mean). The RoPE table is
        shared by all layers of the cache and is not KV; it is not counted."""
        return tensors_nbytes(t for group in self._tier_tensors().values() for t in group)

    def entries(self) -> int:
        """Entries held per (row, head): core + steady + the far tier (sinks and pages)."""
        far = 0
        if self.far is not None:
            held = self.far.paged_lengths() if self.far.keep_pages else [0] * self.rows
            far = max((min(self.far.sinks, n) + p for n, p in zip(self.far.lengths, held, strict=True)), default=0)
        return len(self.core_tier) + len(self.steady_tier) + far

    def attended_entries(self) -> int:
        """Entries in the last decode step's attention (last query, mean over KV heads, largest row)."""
        return 0 if self.last_attended is None else int(round(self.last_attended.max().item()))

    def layer_stats(self) -> dict[str, Any]:
        """Tier sizes, bytes per tier, per-step attention size, pages retrieved, Self-Extend group."""
        far = self.far
        steps = max(self.decode_steps, 1)
        pages_mean = 0.0 if self.pages_total is None else float(self.pages_total.float().mean()) / steps
        return {
            "entries": self.entries(),
            "attended_entries": self.attended_entries(),
            "tiers": {"core": len(self.core_tier), "steady": len(self.steady_tier),
                      "far": max(far.paged_lengths(), default=0) if far is not None and far.keep_pages else 0,
                      "sinks": max((min(far.sinks, n) for n in far.lengths), default=0) if far is not None else 0},
            "tier_bytes": {name: tensors_nbytes(group) for name, group in self._tier_tensors().items()},
            "core_bound": self.core_size,
            "steady_bound": self.steady_bound,
            "pages_retrieved_last_step": 0.0 if self.pages_last is None else float(self.pages_last.float().mean()),
            "pages_retrieved_per_step": pages_mean,
            "retrieval_steps": self.retrieval_steps,
            "decode_steps": self.decode_steps,
            "group_size": max(self.groups, default=1),
            "last_attention_entropy": None if self.last_entropy is None else float(self.last_entropy.mean()),
        }

