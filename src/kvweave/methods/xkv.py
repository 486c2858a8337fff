"""``xkv``: xKV, cross-layer SVD of the KV cache (Chang et al., "xKV: Cross-Layer SVD for KV-Cache
Compression", arXiv 2503.18893), the closest published design to DepthWeave, as a baseline beside it.

What the paper describes, and what this method stores: for each group of ``group`` adjacent layers and each of K
(pre-RoPE) and V separately, the prompt's KV of every layer of the group side by side, ``X = [X_l1 | ... | X_lG]``
(``[n, G·H·D]``), replaced by its truncated SVD ``X ≈ C · R``: one token-side factor ``C: [n, r]`` shared by the
group and per-layer coefficients ``R_l: [r, H·D]``, all at 16 bits. Keys are rebuilt and rotated at their
positions to attend. A fixed rank per side, the value rank ``value_rank`` times the key rank (the paper's
configuration: 512 for keys, 768 for values over groups of 4 on Llama-3.1-8B); here the ranks come from the byte
budget ``compression`` (everything the group holds, against a 16-bit full cache), so xKV and DepthWeave are
compared at equal bytes. Tokens generated after the prompt stay exact (the paper compresses the prefill only), so
the held bytes grow at the full cache's rate while decoding.

It is DepthWeave's machinery with everything DepthWeave adds switched off: no probe-chosen ranks, no attention
weighting of the SVD, no exact sink rows, no ``protect``, no router, 16-bit coordinates, no decode-time folding,
no selective decode (every key rebuilt each step, as in the paper's accuracy runs). What the two differ by is
therefore exactly what DepthWeave adds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from kvweave.methods.depthweave import DepthWeave
from kvweave.methods.depthweave.factorize import available_bytes, side_cost
from kvweave.registry import option, register

if TYPE_CHECKING:
    from kvweave.methods.depthweave.chunk import Plan
    from kvweave.methods.depthweave.ranks import Budget
    from kvweave.methods.depthweave.store import RowStore

NEVER = 2**31 - 1
"""``block`` of xKV: decode tokens are never folded into the factorization."""


@register("xkv")
@dataclasses.dataclass
class XKV(DepthWeave):
    """xKV: cross-layer truncated SVD of pre-RoPE keys and values per group of layers, fixed ranks (baseline)."""

    group: int = option(4, "adjacent layers whose KV is factorized together (1, 2, 4 or 8)")
    compression: float | None = option(
        8.0, "compression vs a 16-bit full cache of the prompt; sets the ranks (decode tokens stay exact)"
    )
    value_rank: float = option(1.5, "value rank / key rank (the paper's 768 / 512)")
    storage: str = option(
        "auto",
        "dtype of what is stored (factors, coefficients, decode tokens): auto (the model's if 16-bit, else "
        "float16), float16, bfloat16 or model",
    )
    # DepthWeave's additions, off (tuning: they still parse, for experiments)
    keys: str = option("pre_rope", "factorize keys pre_rope (the paper's) or post_rope", tuning=True)
    target_error: float | None = option(None, "unused by xKV (fixed ranks)", tuning=True)
    probes: bool = option(False, "probe-chosen ranks (DepthWeave's; off in xKV)", tuning=True)
    router: bool = option(False, "DepthWeave's token router (off in xKV)", tuning=True)
    sinks: int = option(0, "first tokens kept exact (none in xKV)", tuning=True)
    residuals: bool = option(False, "exact residual rows (none in xKV)", tuning=True)
    protect: float = option(0.0, "DepthWeave's exact rows for value-like tokens (none in xKV)", tuning=True)
    residual_bits: int = option(16, "bits of exact rows", tuning=True)
    evict: float = option(0.0, "fraction of tokens dropped (none in xKV)", tuning=True)
    bits: int = option(16, "bits of the token-side factor (16 in xKV)", tuning=True)
    recent: int = option(0, "newest prompt tokens kept exact (none in xKV)", tuning=True)
    block: int = option(NEVER, "decode tokens folded at a time (never in xKV)", tuning=True)
    recent_share: float = option(
        0.5,
        "DepthWeave's budget for a growing window (no effect: xKV never folds decode tokens)",
        tuning=True,
    )
    middle_bits: int = option(
        0, "DepthWeave's integer middle tier (none in xKV: decode tokens stay exact)", tuning=True
    )
    decode_tokens: int = option(0, "selective decode (off in xKV: every key rebuilt)", tuning=True)
    recall: int = option(0, "DepthWeave's rebuilt copies (none in xKV: it never sees token ids)", tuning=True)
    quote: int = option(0, "DepthWeave's rebuilt quotes (none in xKV: it never sees token ids)", tuning=True)
    pin_tokens: int = option(0, "pinned pages of selective decode (off in xKV)", tuning=True)
    weighting: float = option(
        0.0, "attention weighting of the SVD rows (none in xKV: plain SVD)", tuning=True
    )

    reads_token_ids: ClassVar[bool] = False
    budget_options: ClassVar[dict[str, str]] = {"compression": "compression"}
    renamed_options: ClassVar[dict[str, str]] = {}
    test_options: ClassVar[dict[str, object]] = {"group": 2, "compression": 3.0}
    invalid_options: ClassVar[tuple[tuple[dict[str, Any], str], ...]] = (
        ({"protect": 0.02}, "protect"),
        ({"router": True}, "router"),
        ({"recall": 8}, "recall"),
        ({"group": 3}, "group"),
        ({"compression": 0.5}, "compression"),
        ({"value_rank": 0.0}, "value_rank"),
        ({"storage": "int8"}, "storage"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, off in (
            ("protect", 0.0),
            ("router", False),
            ("recall", 0),
        ):  # they read token ids, which xKV never sees
            if getattr(self, name) != off:
                raise ValueError(
                    f"{self.name}: option {name}={getattr(self, name)!r} is DepthWeave's, not xKV's; "
                    f"use depthweave:{name}=... (allowed here: {off})"
                )
        self.check_range("value_rank", 0.05, 20.0)
        if self.compression is None:
            raise ValueError(
                f"{self.name}: option compression=None: xKV's ranks come from it; give a number >= 1"
            )

    def fixed_ranks(
        self, store: RowStore, plan: Plan, caps: dict[str, int], budget: Budget
    ) -> dict[str, int]:
        """The largest key rank ``r`` (value rank ``value_rank·r``) whose factors and coefficients fit the
        bytes ``compression`` leaves (at least rank 1 each: a prompt too short for the budget says so in the
        held bytes, never silently exact)."""
        cost = side_cost(store, plan, caps)
        available = available_bytes(store, plan, budget)

        def ranks(key: int) -> dict[str, int]:
            return {"k": min(key, caps["k"]), "v": max(1, min(round(key * self.value_rank), caps["v"]))}

        def fits(key: int) -> bool:
            chosen = ranks(key)
            return cost("k", chosen["k"]) + cost("v", chosen["v"]) <= available

        low, high = 1, max(caps["k"], round(caps["v"] / self.value_rank), 1)
        while low < high:  # the largest fitting key rank (bytes grow with the rank)
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return ranks(low)
