"""``depthweave``: DepthWeave-KV, token-adaptive cross-layer residual factorization (seed ``002_*.txt``).

What it stores, for each group of ``group`` adjacent full-attention layers and each of K and V separately::

    X = [X_l1 | ... | X_lG]            [n, G·H·D]   keys pre-RoPE (de-rotated) by default, or post-RoPE
    X ≈ C · R,  R = [R_l1 | ... | R_lG]        C: [n, r] token-side base ("B" in the seed), R_l: [r, H·D]

- ``R`` comes from a truncated SVD of the group's prefill KV (``lowrank.top_basis``), computed when the
  group's last layer has stored its KV ("compress on group complete"); that group's exact KV is then freed.
  Rows are weighted by the attention the prompt's last queries pay them (``weighting``).
- Exact residual rows (``E_l = K_l - C·R_l`` with an empty base row, i.e. the exact post-RoPE rows, 16-bit or
  INT8) always for the attention sinks; with ``router=True`` also for the router's top ``residual_tokens``.
  Exact-row tokens are left out of the SVD: sink keys/values are outliers that would spend the basis.
- ``router=True``: a calibration-free router scores tokens by the attention the last prompt queries pay them
  (max-pooled over neighbours, SnapKV-style), the novelty of their KV (energy outside a provisional low-rank
  basis: numbers, UUIDs, names and rare words are what a shared basis represents worst, whatever their
  characters) and token content (in-prompt rarity, digits, capitalised tokens). Each signal becomes a
  percentile and a token takes its best one, so one signal is enough (a needle needs no attention from the
  prompt's end). Buckets are ragged, each its own ``[n_b, w_b]`` coordinate tensor (no zero padding):
  top -> exact rows, next ``hi_tokens`` -> width ``r·spread``, ``lo_tokens`` -> ``r/spread``, rest -> ``r``;
  the lowest ``evict`` fraction can be dropped (eviction, then factorize what is kept).
- ``protect``: a fraction of the prompt's tokens kept as exact rows because of what they *are*, question-
  agnostically: tokens with digits (numbers, dates, UUID and hex pieces) and their neighbours, then identifier-
  like tokens rare in the prompt (``snake_case``, ``camelCase``, capitalised names), then other rare words
  (:func:`~kvweave.methods.depthweave.router.retrievable_scores`). The token ids reach the cache by themselves
  on every path (each forward pass of a prepared model hands its ``input_ids`` over, :mod:`kvweave.prompt`), the
  tokenizer from ``load_model`` or ``make_cache(..., tokenizer=)``; ``cache.set_prompt`` overrides both. Exact rows are always attended
  (selective decode never skips them) and the byte budget pays for them (the ranks drop to fit).
  ``protect_names=N`` (default 2 since spec version 6; 0 turns it off: docs/findings.md, twenty-first to
  twenty-fourth sessions) ranks values of 5+ digit tokens above shorter numbers and keeps each one's name (the
  tokens back to the Nth word before it) exact with it: in a long generation the needles lost were the wrong
  key's value, and the names were folded.
  Where the named values need more rows than ``protect``'s fraction (short prompts) they get them, up to twice
  it; the budget pays as for any exact row. ``protect_records=N`` (default 6 since spec version 7; 0 turns
  it off: docs/findings.md, twenty-third to twenty-sixth sessions) does the same for values that look like nothing in particular (common words): the
  fields of a repeated record — the tokens after a phrase of ``N``+ tokens that recurs 2–16 times and goes on
  differently each time, up to the sentence's end (``One of the special magic words for`` | ``nice-gondola is:
  window`` | ``.``) — rank first among ``protect``'s rows (after named values), inside its fraction; a prompt
  of records throughout (fields past 3 % of its tokens: code, reference docs) has none singled out.
- Ranks: attention-output probes (the last ``probe`` prompt queries of every layer attend over the chunk with
  exact vs stored KV; relative output error) pick ``r_K`` and ``r_V`` per group and batch row: the cheapest
  pair meeting ``target_error``, or the best pair inside the byte budget of ``compression`` (everything the
  group holds, recent buffer, exact rows and indices included, against a 16-bit full cache of the group).
- ``recall=N`` (default 8 since spec version 8; 0 turns it off: docs/findings.md, twenty-sixth to
  twenty-eighth sessions): when a decode step's newest ``N`` ids occurred before, the passage that followed
  them is rebuilt from its token ids (one forward pass, 64 tokens of context) and attended in place of its
  stored form (its exact rows excepted) while the copy goes on, as 4-bit blocks (``recall_bits``); their bytes
  count while held, the ids (4 bytes a position) always (:mod:`kvweave.methods.depthweave.recall`).
  Transformers paths only: vLLM's ``depthweave`` sees no ids. Under tensor parallelism every rank matches the
  same ids and rebuilds the same spans, each its own heads (``tests/engines/test_tensor_parallel.py``).
- ``quote=N`` (default 3 since spec version 9; docs/findings.md, thirty-first to thirty-fourth sessions: it
  finds word values the default loses): a question fed after its document (a
  multi-token step of at most 512 tokens over the compressed cache) rebuilds, the same way, the passages around
  what it quotes — each run of ``N`` or more of its ids that occurred exactly once in the compressed part, up to
  four passages a row, longest runs first — and that step and the decode steps after it attend to them, held
  32 steps after the question or after the last step whose newest ``N`` ids occur inside them. The
  value a question asks for follows the words that name it, whatever it looks like (common words, hex), so its
  exactness does not depend on ``protect``'s content rules. A question inside a prompt prefilled whole is no
  such step (``pin_tokens`` covers that case); a prompt fed in chunks of 512 tokens or fewer is a series of
  them, each rebuilding what it repeats of the chunks before. ``quote_context``: the tokens of context each
  passage is rebuilt with (default 64); ``quote_after``: how far past the quote it reaches (default 16);
  ``quote_repeats``: runs said up to that many times count too, each occurrence's passage rebuilt (default 1;
  4 quotes a multi-value needle's key, said once per value, and measured +6 points there at 4K but a trial
  lost on multi-query, where the needles share their wording: docs/findings.md, thirty-fifth session);
  ``quote_over``: ``ids`` (default) rebuilds each passage from ``quote_context`` tokens of its ids run from no
  cache, ``cache`` runs its ids over the compressed cache's own keys and values of everything before it (the
  passage then sees its whole context as the cache holds it: docs/findings.md, thirty-eighth session).
- Decoding: new tokens stay exact in a recent buffer; at ``recent + block`` tokens the oldest are folded in
  (projected onto the basis). The current queries probe the folded chunk; an error above ``drift`` x the
  group's reference refreshes the basis (top directions of the stored reconstruction plus the new chunk;
  old coordinates are re-expressed, never recomputed from exact KV). With ``target_error`` the probe also
  raises or lowers the rank of later chunks. Memory per token stays at the compressed rate. Of the budget the
  tokens after the prompt bring, ``recent_share`` (default 0.8) keeps the newest unfolded: the buffer grows to
  about ``recent_share x generated / compression`` exact tokens' worth (never past what the budget has spare),
  because a long generation's next-token loss rests on its newest tokens (the 20,000-step soak: +7–17 % over
  ``full`` with ``recent`` alone, +2–6 % with a share of 0.5, same bytes). Beyond the newest ``recent`` those
  tokens wait as KIVI integer blocks of 32 (``middle_bits=4``, :mod:`.middle`: keys per channel, values per
  token, ``quant``'s block layout, attended from the codes by its C++ kernel) instead of exact, so the share
  holds ~3x as many (2 bits: ~5x, measured worse; 0: all exact, the previous default). Soak, steps 1,000–2,500 at ~8x: +0.8 to +6.1 % over ``full`` against +2.3 to +8.4 % with
  exact tokens and a share of 0.5. The window is priced as exact up to ``recent`` plus half a block, so nothing
  changes before ``recent x compression / recent_share`` tokens have been generated (320 at the defaults): short
  answers fold as before.
- Attention never materialises values: ``P·V ≈ (P·C_v)·R_v`` per bucket. Post-RoPE keys use latent scores
  ``q·(C R_k)ᵀ = (q R_kᵀ)·Cᵀ``; pre-RoPE keys must be rebuilt (the rotation depends on the token and does not
  commute with a token-side base).
- **Selective decode** (``decode_tokens``, default 512, the fastest measured at 16K with unchanged 4K/8K answers; :mod:`.select`): each segment keeps per layer INT8 page
  summaries (per-channel min/max of ``page`` stored keys, rounded outwards; their bytes are part of the
  ``compression`` budget). A decode step (one new query per row) bounds ``q·k`` per page, keeps the top
  ``decode_tokens / page`` pages per KV head, and rebuilds, rotates and scores only those tokens — in one fused
  kernel straight from the packed coordinates (C++ on CPU, :mod:`kvweave.kernels.cpu_factor`; Triton on CUDA,
  :mod:`kvweave.kernels.triton_factor`; ``kernel=torch`` is the tested reference) — then
  attends exactly over them, the exact rows and the recent buffer. Other compressed tokens get no weight that
  step (Quest-style sparsity). Multi-token steps (a question fed after the document) and stores with no more
  pages than the budget attend over everything. ``pin_tokens`` of the budget go to the pages that the last
  multi-token step over the compressed cache (a question fed after the document, which attends over everything)
  gave the most attention, per layer and KV head (after a prompt prefilled whole: the attention of its last
  ``window`` queries, which hold the question when it is inside the prompt): those pages are attended at every
  step until the next such step, whatever their bounds (:func:`.select.pin_pages`). ``decode_tokens=0`` is the
  previous path (every key rebuilt every step, no summaries).
- ``bits=8|4`` stores the token-side coordinates as integers, scales per column over groups of 64 rows;
  coefficients ``R`` (shared by every token) at 8 bits. 16-bit storage is float16 for float32 models.

Measured (``benchmarks/depthweave_probe.py``; qwen2.5-coder-0.5b, 2 KV heads x 64, 24 layers; 2048 tokens of
wikitext-2 valid; "held-out": relative attention-output error of the next 128 tokens' queries over the
compressed tokens, exact vs stored, mean over layers; "KL": next-token KL of those 128 tokens vs the full
cache; every row 8.0x against a 16-bit full cache unless noted):

    setting                                                      held-out error   KL      top-1
    plain truncated SVD, G=1 r=16 (no recent, 16-bit; 6.7x)        71%            0.89    56%
    plain truncated SVD, G=4 r=64 (no recent, 16-bit; 6.2x)        67%            0.42    71%
    defaults: G=8, INT4, recent=32, uniform rank, sinks exact        16%            0.033   91%
      group=1 / 2 / 4                                                27 / 21 / 18%  0.10 / 0.043 / 0.042
      bits=16 / 8                                                    26 / 16%       0.17 / 0.038
      recent=128 (half the bytes go to the recent buffer at 2K)      20%            0.076
      residuals=False (sinks factorized too)                         27%            0.078
      router=True (buckets 2r/r/r/2 for 20/50/30%, 2% exact rows)    19%            0.068
      router=True, 0.5% exact rows only (spread=1, no buckets)       16%            0.039
      router=True, evict=0.5                                         26%            0.15
      keys=post_rope                                                 20%            0.047
      weighting=0                                                    17%            0.036
      probes=False, rank=192 (8.6x)                                  16%            0.037
      compression=4 / 16                                            13 / 25%       0.024 / 0.12

What carries the quality: exact sinks, INT4 coordinates (4x the rank for the bytes), a small recent buffer and
larger groups. The router's buckets and 2% exact rows lose at 2K tokens: a high bucket adds coefficient rows
(at n = 2K a basis row costs as much as a coordinate column) and 16-bit exact rows are 8x the price of a
factorized token; so ``router`` is off by default (it may pay on long contexts and needle tasks: measure
with ``kvweave eval``). Passkey at 4K tokens, 7.7x: 5/5 depths with router on, off and without exact rows.
The prefill probe error (queries the router also saw) is within ~10% of the held-out error.

Code: ``__init__`` (this module: the options), ``layer`` (the cache layer), ``group`` (layer groups: their recent
buffers and the folding), ``store`` (one batch row's storage), ``factorize`` (bases, coefficients, refresh),
``ranks`` (rank choice), ``router`` (token kinds), ``probes``, ``parts`` (attention over stored parts),
``chunk`` (what one fold hands over), ``middle`` (the recent buffer's integer blocks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvweave.kernels.registry import BACKENDS
from kvweave.methods.depthweave.chunk import EVICTED, EXACT, HI, LO, MID, Chunk, Plan
from kvweave.methods.depthweave.group import WeaveGroup
from kvweave.methods.depthweave.layer import DepthWeaveLayer
from kvweave.methods.depthweave.parts import DensePart, FactorPart, attend_parts
from kvweave.methods.depthweave.probes import Probe
from kvweave.methods.depthweave.ranks import (
    RANK_GRID,
    Budget,
    best_within,
    cheapest_meeting,
    interpolate,
    next_rank,
    other_side,
)
from kvweave.methods.depthweave.recall import Recall
from kvweave.methods.depthweave.router import (
    POOL,
    content_scores,
    make_plan,
    novelty_score,
    observed_attention,
    percentile,
    protected,
    retrievable_scores,
    router_score,
)
from kvweave.methods.depthweave.store import COORD_GROUP, RowStore, Segment
from kvweave.ops.storage import STORAGE_CHOICES, storage_dtype
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache

__all__ = [
    "COORD_GROUP",
    "EVICTED",
    "EXACT",
    "HI",
    "LO",
    "MID",
    "POOL",
    "RANK_GRID",
    "Budget",
    "Chunk",
    "DensePart",
    "DepthWeave",
    "DepthWeaveLayer",
    "FactorPart",
    "Plan",
    "Probe",
    "RowStore",
    "Segment",
    "WeaveGroup",
    "attend_parts",
    "best_within",
    "cheapest_meeting",
    "content_scores",
    "interpolate",
    "make_plan",
    "next_rank",
    "other_side",
    "novelty_score",
    "observed_attention",
    "percentile",
    "protected",
    "retrievable_scores",
    "router_score",
]


@register("depthweave")
@dataclasses.dataclass
class DepthWeave(Method):
    """DepthWeave-KV: cross-layer shared token bases, token-adaptive ranks, exact rows, probe-chosen ranks."""

    vllm: ClassVar[str] = (
        "served by the vLLM plugin in its per-layer form only, KVWEAVE_VLLM_METHOD=depthweave (a basis per "
        "request and layer fitted once to the first prefill chunk, fixed ranks, INT4 coordinates in vLLM's "
        "blocks, the worst-represented tokens exact; selective decode over whole 128-token blocks with "
        "decode_tokens=N, off by default there; no cross-layer bases, probes, protect or refits: vLLM's blocks "
        "are per layer and immutable once full; docs/vllm.md)"
    )

    group: int = option(8, "adjacent full-attention layers sharing one token-side base (1, 2, 4 or 8)")
    keys: str = option(
        "pre_rope", "factorize keys pre_rope (de-rotated) or post_rope (latent scores, no rotation)"
    )
    compression: float | None = option(
        8.0, "compression vs a 16-bit full cache each group aims for at prefill"
    )
    target_error: float | None = option(
        None, "relative attention-output probe error each group aims for (when set, compression is ignored)"
    )
    rank: int = option(
        32,
        "base rank when probes=False (and the provisional rank of the router's novelty signal)",
        tuning=True,
    )
    probes: bool = option(
        True, "choose ranks with attention-output probes (False: the fixed rank)", tuning=True
    )
    probe: int = option(16, "last prompt queries used as probes", tuning=True)
    router: bool = option(
        False, "token-adaptive buckets, exact rows and eviction (False: uniform rank, sinks exact)"
    )
    window: int = option(32, "last prompt queries whose attention the router reads", tuning=True)
    sinks: int = option(
        4,
        "first tokens kept exact (attention sinks); 64 also keeps a chat prompt's system prompt and instruction "
        "exact, which the answer's format reads (docs/findings.md, thirty-sixth session)",
        tuning=True,
    )
    residuals: bool = option(True, "keep exact residual rows (router top tokens and sinks)", tuning=True)
    residual_tokens: float = option(0.02, "fraction of tokens kept as exact residual rows", tuning=True)
    protect: float = option(
        0.02,
        "fraction of prompt tokens kept as exact rows because they look like values users retrieve (digits, "
        "identifiers, rare names: read from the prompt's tokens); counted in the compression budget",
    )
    protect_names: int = option(
        2,
        "with protect: rank values of 5+ digit tokens first and keep their names (the tokens back to the Nth "
        "word before them) exact with them, past protect's fraction where they need it, up to twice it (0: off)",
        tuning=True,
    )
    protect_records: int = option(
        6,
        "with protect: keep the fields of repeated records exact, whatever their characters: the tokens after a "
        "phrase of N+ tokens that recurs 2-16 times and goes on differently each time, to the sentence's end, "
        "first among protect's rows after named values; none where fields are over 3% of the prompt (code) "
        "(0: off)",
        tuning=True,
    )
    residual_bits: int = option(
        16, "bits of residual rows: 16 (model dtype) or 8 (INT8, a scale per row and head)"
    )
    hi_tokens: float = option(
        0.2, "fraction of factorized tokens in the high-rank bucket (rank·spread)", tuning=True
    )
    lo_tokens: float = option(
        0.3, "fraction of factorized tokens in the low-rank bucket (rank/spread)", tuning=True
    )
    spread: float = option(2.0, "rank ratio between buckets: r_hi = r·spread, r_lo = r/spread", tuning=True)
    evict: float = option(0.0, "fraction of tokens dropped, lowest router score first (0: none)")
    bits: int = option(4, "bits of the token-side bases: 16, 8 or 4 (coefficients at 8 when below 16)")
    recent: int = option(32, "newest tokens kept exact")
    recent_share: float = option(
        0.8,
        "share of the byte budget of the tokens after the prompt spent on keeping the newest exact (about "
        "recent_share x generated / compression tokens, never fewer than recent, never past the budget); "
        "0: always recent",
        tuning=True,
    )
    middle_bits: int = option(
        4,
        "bits of the recent buffer's middle tier: 4 (or 8, 2) keeps the unfolded tokens beyond the newest recent "
        "as KIVI integer blocks (keys per channel, values per token), so recent_share's bytes hold ~3x (2-5x) "
        "more of them; 0: all exact",
        tuning=True,
    )
    block: int = option(64, "tokens folded into the factorization at a time while decoding", tuning=True)
    decode_tokens: int = option(
        512,
        "compressed tokens each decode step attends per KV head: the pages whose upper bound of q·k is highest "
        "(page summaries kept per layer, counted in the budget); 0: every token, exactly, no summaries",
    )
    page: int = option(64, "tokens per page summary (decode_tokens > 0)", tuning=True)
    page_choice: str = option(
        "max",
        "how a decode step picks its pages per KV head: max (highest bound over the head's query heads), "
        "fair (each query head's best pages in turn) or mass (each query head's pages until their "
        "bound-estimated attention covers 90 %, between the budget and twice it)",
        tuning=True,
    )
    pin_tokens: int = option(
        0,
        "of the decode_tokens, compressed tokens per KV head every decode step attends whatever their bounds: "
        "the pages the last multi-token step over the compressed cache (a question fed after the document) or, "
        "after a prompt prefilled whole, its last window queries attended most; 0: none",
        tuning=True,
    )
    pin_window: int = option(
        0,
        "last prompt queries whose attention pins pages after a prompt prefilled whole (pin_tokens); 0: the "
        "router's window",
        tuning=True,
    )
    kernel: str = option(
        "auto",
        "selective decode: cpp (fused C++ CPU kernel on the packed coordinates), triton (fused Triton kernels, "
        "CUDA), torch (gather, dequantize, matmul: the reference) or auto (triton on CUDA, cpp on CPU)",
        tuning=True,
    )
    drift: float = option(
        1.5, "probe error / reference ratio that refreshes the basis while decoding", tuning=True
    )
    weighting: float = option(
        1.0, "attention weighting of the SVD rows: weight 1 + weighting·attention/mean", tuning=True
    )
    recall: int = option(
        8,
        "decode steps whose newest N ids occurred before rebuild the passage that followed them from its token "
        "ids (one forward pass over it) and attend to it while the copy goes on; 0: off",
        tuning=True,
    )
    quote: int = option(
        3,
        "a multi-token step of at most 512 tokens over the compressed cache (a question fed after its document): "
        "each run of N or more of its ids that occurred once before rebuilds the passage around it (up to 4 a "
        "row), attended by that step and the decode steps after it while the answer copies from them; 0: off",
        tuning=True,
    )
    quote_context: int = option(
        64,
        "with quote: tokens of context the model sees before each quoted passage it rebuilds (more: keys and values "
        "closer to the document's, a longer question step)",
        tuning=True,
    )
    quote_over: str = option(
        "ids",
        "with quote: what each quoted passage is rebuilt over: ids (quote_context tokens of its ids run from no "
        "cache) or cache (the passage's ids run over the compressed cache's own keys and values of everything "
        "before it, materialised for the question step: a full cache's bytes of the row, for a moment)",
        tuning=True,
    )
    quote_after: int = option(
        16,
        "with quote: tokens each quoted passage reaches past the quote (the value a question asks for follows it; "
        "with 4-bit passages, 16 before plus this, in whole blocks of 32)",
        tuning=True,
    )
    quote_repeats: int = option(
        1,
        "with quote: a run of the question's ids counts as a quote when it occurred at most N times before, each "
        "occurrence's passage rebuilt (4 a row in all); a key said once per value (multi-value needles) needs 4",
        tuning=True,
    )
    recall_bits: int = option(
        4,
        "with recall: the rebuilt passage held as 4-bit blocks (the middle tier's layout) or at 16 bits",
        tuning=True,
    )
    storage: str = option(
        "auto",
        "dtype of 16-bit storage (recent buffer, exact rows, unquantized bases): auto "
        "(the model's if 16-bit, else float16), float16, bfloat16 or model",
    )

    needs_positions = True
    cross_layer = True
    reads_token_ids = True  # the router's content signal and protect read the prompt's tokens
    budget_options = {"compression": "compression", "decode_tokens": "attended tokens"}
    renamed_options = {"target_ratio": "compression"}
    test_options = {
        "recent": 8,
        "block": 8,
        "group": 2,
        "compression": 3.0,
        "probe": 4,
        "window": 8,
        "sinks": 2,
        "decode_tokens": 8,
        "page": 4,
    }
    invalid_options: ClassVar[tuple[tuple[dict[str, Any], str], ...]] = (
        ({"group": 3}, "group"),
        ({"keys": "middle"}, "keys"),
        ({"compression": 0.5}, "compression"),
        ({"target_error": 0.0}, "target_error"),
        ({"rank": 0}, "rank"),
        ({"probe": 0}, "probe"),
        ({"window": 0}, "window"),
        ({"sinks": -1}, "sinks"),
        ({"residual_tokens": 1.5}, "residual_tokens"),
        ({"residual_bits": 4}, "residual_bits"),
        ({"protect": 0.9}, "protect"),
        ({"hi_tokens": -0.1}, "hi_tokens"),
        ({"hi_tokens": 0.7, "lo_tokens": 0.5}, "lo_tokens"),
        ({"spread": 0.5}, "spread"),
        ({"evict": 1.0}, "evict"),
        ({"evict": 0.5, "router": False}, "evict"),
        ({"bits": 5}, "bits"),
        ({"recent": -1}, "recent"),
        ({"recent_share": 0.95}, "recent_share"),
        ({"page_choice": "best"}, "page_choice"),
        ({"middle_bits": 3}, "middle_bits"),
        ({"block": 0}, "block"),
        ({"decode_tokens": -1}, "decode_tokens"),
        ({"page": 0}, "page"),
        ({"pin_tokens": -1}, "pin_tokens"),
        ({"pin_window": -1}, "pin_window"),
        ({"kernel": "cuda"}, "kernel"),
        ({"drift": 0.9}, "drift"),
        ({"storage": "int8"}, "storage"),
        ({"recall": 1}, "recall"),
        ({"quote": 1}, "quote"),
        ({"recall_bits": 8}, "recall_bits"),
    )

    def __post_init__(self) -> None:
        self.check_choice("group", [1, 2, 4, 8])
        self.check_choice("keys", ["pre_rope", "post_rope"])
        if self.compression is not None:
            self.check_range("compression", 1.0)
        if self.target_error is not None:
            self.check_range("target_error", 1e-6, 10.0)
            if self.target_error < 1e-6:
                raise ValueError(f"{self.name}: option target_error={self.target_error!r} must be > 0")
        self.check_range("rank", 1)
        self.check_range("decode_tokens", 0)
        self.check_range("page", 1)
        self.check_range("pin_tokens", 0)
        self.check_range("pin_window", 0)
        self.check_choice("kernel", list(BACKENDS))
        self.check_choice("page_choice", ["max", "fair", "mass"])
        self.check_range("probe", 1)
        self.check_range("window", 1)
        self.check_range("sinks", 0)
        self.check_range("residual_tokens", 0.0, 1.0)
        self.check_choice("residual_bits", [16, 8])
        self.check_range("protect", 0.0, 0.5)
        self.check_range("protect_names", 0)
        self.check_range("protect_records", 0)
        self.check_choice("recall_bits", [16, 4])
        self.check_range("quote_context", 0, 8192)
        self.check_range("quote_after", 1, 512)
        self.check_choice("quote_over", ["ids", "cache"])
        self.check_range("quote_repeats", 1, 64)
        if self.recall == 1 or self.recall < 0:
            raise ValueError(
                f"{self.name}: option recall={self.recall!r} is out of range; allowed 0 (off) or 2 and more "
                "(the ids a copy must match)"
            )
        if self.quote == 1 or self.quote < 0:
            raise ValueError(
                f"{self.name}: option quote={self.quote!r} is out of range; allowed 0 (off) or 2 and more "
                "(the ids a quote must match)"
            )
        self.check_range("hi_tokens", 0.0, 1.0)
        self.check_range("lo_tokens", 0.0, 1.0 - self.hi_tokens)
        self.check_range("spread", 1.0, 64.0)
        self.check_range("evict", 0.0, 0.99)
        if self.evict > 0 and not self.router:
            raise ValueError(
                f"{self.name}: option evict={self.evict!r} needs router=True (eviction follows router "
                "scores); allowed with router=False: 0"
            )
        self.check_choice("bits", [16, 8, 4])
        self.check_range("recent", 0)
        self.check_range("recent_share", 0.0, 0.9)
        self.check_choice("middle_bits", [0, 8, 4, 2])
        self.check_range("block", 1)
        self.check_range("drift", 1.0)
        self.check_choice("storage", STORAGE_CHOICES)
        self.check_range("weighting", 0.0)

    @property
    def pinning(self) -> bool:
        """Whether decode steps read pinned pages (``pin_tokens`` of a selective ``decode_tokens`` budget)."""
        return self.pin_tokens > 0 and self.decode_tokens > 0

    @property
    def coefficient_bits(self) -> int:
        """Bits of the per-layer coefficients ``R_l`` (never below 8: every token of the group uses them)."""
        return 16 if self.bits == 16 else 8

    def bucket_widths(self, rank: int, cap: int) -> tuple[int, int, int]:
        """Coordinate widths ``(hi, mid, lo)`` for base rank ``rank`` (at most ``cap``)."""
        mid = max(1, min(rank, cap))
        if not self.router:
            return mid, mid, mid
        return (
            min(cap, max(mid, math.ceil(rank * self.spread))),
            mid,
            max(1, min(mid, int(rank / self.spread))),
        )

    def fixed_ranks(
        self, store: RowStore, plan: Plan, caps: dict[str, int], budget: Budget
    ) -> dict[str, int]:
        """``r_K, r_V`` of a prefill factorization without probes: the fixed ``rank`` (xKV sizes them from the
        byte budget instead)."""
        return {s: min(self.rank, caps[s]) for s in ("k", "v")}

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of everything stored at 16 bits (``model``: the model's own, also when it is float32)."""
        return storage_dtype(self.storage, model_dtype)

    def before_forward(self, cache: KVCache, decoder: Any) -> None:
        """Before each forward pass (its ids observed): ``recall``'s copy detection and rebuilds
        (:mod:`kvweave.methods.depthweave.recall`)."""
        if self.recall <= 0 and self.quote <= 0:
            return
        state = cache.context.decode_state
        if not isinstance(state, Recall):
            state = cache.context.decode_state = Recall()
        state.step(cache, decoder)

    def context_tensors(self, context: Any) -> list[torch.Tensor]:
        """With ``recall``: the token ids of every position (4 bytes each), which it matches while decoding."""
        ids = context.prompt_ids if self.recall > 0 or self.quote > 0 else None
        return [] if ids is None else [ids]

    def make_layer(self, cache: KVCache, layer_idx: int) -> DepthWeaveLayer:
        return DepthWeaveLayer(cache, layer_idx, self)

    def bind_layers(self, cache: KVCache) -> None:
        """Form the groups, once: each ``group`` consecutive layers this method built (in index order) share a
        :class:`WeaveGroup`, stored in ``cache.context.groups`` by index; each layer gets a reference to its group."""
        layers = [layer for layer in cache.layers if isinstance(layer, DepthWeaveLayer)]
        for index, start in enumerate(range(0, len(layers), self.group)):
            cache.context.groups[index] = WeaveGroup(layers[start : start + self.group], index)
