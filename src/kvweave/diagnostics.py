"""The measurements seed ``000`` argues from (§二), taken on a real model instead of asserted.

- :func:`key_similarity_by_distance`: cosine similarity and covariance of keys ``K_i, K_{i+d}`` against the token
  distance ``d`` (the seed's "far and near keys become homogeneous", §二.1), pre- and post-RoPE, and after
  removing each head's mean key (what decoupling removes).
- :func:`entropy_by_length`: next-token entropy against context length (the seed reports 1.27 nats at 8K rising
  to 2.41 at 128K, §二.3), optionally with a kvweave cache method.
- :func:`rope_phase_range`: the largest RoPE angle per frequency at length ``L`` against the trained length (the
  seed's "phase folding" beyond the trained range, §二.2), and what DK-Cache's Self-Extend remapping keeps.

Everything returns plain dicts and lists (JSON-able). :func:`run_diagnostics` runs all three from text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvweave._compat import DynamicCache, cache_kwarg, text_config
from kvweave.ops.rope import Rotary, find_rotary


def _trained_length(model: Any) -> int:
    return int(text_config(model.config).max_position_embeddings)


def _default_distances(length: int) -> list[int]:
    return [2**k for k in range(int(math.log2(max(length - 1, 1))) + 1) if 2**k < length]


def layer_keys(model: Any, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE and pre-RoPE keys ``[H, T, D]`` (float32) of every full-attention layer for ``input_ids: [1, T]``."""
    config = text_config(model.config)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids, use_cache=True, **{cache_kwarg(model): cache})
    rotary = find_rotary(model)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).view(1, -1)
    keys = {}
    for idx, layer in enumerate(cache.layers):
        post = getattr(layer, "keys", None)
        if post is None or post.shape[2] != input_ids.shape[1]:  # sliding-window layers hold a window only
            continue
        post = post[0:1].float()
        pre = Rotary(rotary, layer_types[idx]).unrotate(post, positions) if rotary is not None else post
        keys[idx] = (post[0], pre[0])
    return keys


def _pair_stats(keys: torch.Tensor, distance: int, samples: int) -> tuple[float, float]:
    """Mean cosine and mean per-channel covariance of ``(K_i, K_{i+d})`` over sampled ``i``, heads, channels."""
    count = keys.shape[1] - distance
    index = torch.linspace(0, count - 1, min(samples, count)).round().long().unique()
    first, second = keys[:, index], keys[:, index + distance]  # [H, n, D]
    cosine = torch.nn.functional.cosine_similarity(first, second, dim=-1).mean().item()
    covariance = ((first * second).mean(1) - first.mean(1) * second.mean(1)).mean().item()
    return cosine, covariance


def key_similarity_by_distance(
    model: Any, input_ids: torch.Tensor, distances: Sequence[int] | None = None, samples: int = 1024
) -> dict[str, Any]:
    """Key cosine similarity / covariance against token distance, per layer and averaged over layers.

    ``input_ids: [1, T]``. For each distance ``d`` and each full-attention layer: the mean over sampled
    positions ``i`` and heads of ``cos(K_i, K_{i+d})`` for post-RoPE keys (what attention sees), pre-RoPE keys
    (content) and pre-RoPE keys minus each head's mean key (what decoupling removes), and the mean per-channel
    covariance ``E[K_i K_{i+d}] − E[K_i] E[K_{i+d}]`` of pre-RoPE keys (the seed's ``Cov(K_i, K_j)``).
    """
    length = input_ids.shape[1]
    distances = [d for d in (distances or _default_distances(length)) if 0 < d < length]
    keys = layer_keys(model, input_ids[:1])
    measures: dict[str, list[list[float]]] = {
        "cosine_post_rope": [],
        "cosine_pre_rope": [],
        "cosine_pre_rope_demeaned": [],
        "covariance_pre_rope": [],
    }
    for post, pre in keys.values():
        demeaned = pre - pre.mean(1, keepdim=True)
        rows: dict[str, list[float]] = {name: [] for name in measures}
        for d in distances:
            rows["cosine_post_rope"].append(_pair_stats(post, d, samples)[0])
            cosine, covariance = _pair_stats(pre, d, samples)
            rows["cosine_pre_rope"].append(cosine)
            rows["covariance_pre_rope"].append(covariance)
            rows["cosine_pre_rope_demeaned"].append(_pair_stats(demeaned, d, samples)[0])
        for name in measures:
            measures[name].append(rows[name])
    result: dict[str, Any] = {"tokens": length, "distances": distances, "layers": list(keys)}
    for name, per_layer in measures.items():
        mean = torch.tensor(per_layer).mean(0).tolist() if per_layer else []
        result[name] = {"mean": mean, "per_layer": per_layer}
    return result


def entropy_by_length(
    model: Any, input_ids: torch.Tensor, lengths: Sequence[int], window: int = 32, method: str | None = None
) -> dict[str, Any]:
    """Mean next-token entropy (nats) of the ``window`` positions before each context length.

    ``input_ids: [1, T]``, one forward pass over ``max(lengths)`` tokens, logits only at the measured positions.
    ``method``: a kvweave cache spec (e.g. ``"dkcache"``) to measure with that cache instead of the plain model.
    """
    from kvweave.sampling import entropy

    lengths = sorted({int(n) for n in lengths if 1 <= n <= input_ids.shape[1]})
    if not lengths:
        raise ValueError(f"entropy_by_length: no length within the {input_ids.shape[1]} tokens given")
    spans = [list(range(max(0, n - window), n)) for n in lengths]
    keep = torch.tensor(sorted({p for span in spans for p in span}), device=input_ids.device)
    kwargs: dict[str, Any] = {}
    if method is not None:
        from kvweave.cache import make_cache

        kwargs[cache_kwarg(model)] = make_cache(method, model)
    with torch.no_grad():
        logits = model(input_ids[:1, : lengths[-1]], logits_to_keep=keep, **kwargs).logits[0]
    where = {int(p): i for i, p in enumerate(keep.tolist())}
    per_position = entropy(logits)
    means = [per_position[[where[p] for p in span]].mean().item() for span in spans]
    return {
        "lengths": lengths,
        "window": window,
        "method": method or "plain model",
        "entropy": means,
        "trained_length": _trained_length(model),
    }


def _inverse_frequencies(model: Any) -> dict[str, torch.Tensor]:
    rotary = find_rotary(model)
    if rotary is None:
        return {}
    found = {
        name: buf
        for name, buf in rotary.named_buffers()
        if name.endswith("inv_freq") and "original" not in name
    }
    return {
        name.removesuffix("inv_freq").rstrip("_") or "default": buf.float().cpu()
        for name, buf in found.items()
    }


def rope_phase_range(
    model: Any, lengths: Sequence[int], trained_length: int | None = None, window: int | None = None
) -> dict[str, Any]:
    """Largest RoPE angle per frequency at each length vs at the trained length.

    A frequency ``θ`` whose angle never completes a turn inside the trained range (``(L_train − 1)·θ < 2π``)
    meets angles at length ``L`` that training never showed once ``L > L_train``: those are the "unseen"
    frequencies (the seed's phase folding). With DK-Cache's compensation (core ``window``, default
    ``L_train / 16``) the largest relative position is ``(L − 1) // G + window − window // G < L_train``.
    """
    from kvweave.methods.dkcache import default_bounds, group_size

    trained = trained_length or _trained_length(model)
    window = window if window is not None else default_bounds(trained)[0]
    result: dict[str, Any] = {
        "trained_length": trained,
        "lengths": [int(n) for n in lengths],
        "window": window,
        "rope": {},
    }
    for name, inv_freq in _inverse_frequencies(model).items():
        trained_angle = (trained - 1) * inv_freq
        unseen_frequencies = trained_angle < 2 * math.pi
        rows = []
        for length in lengths:
            angle = (length - 1) * inv_freq
            group = group_size(length, window, trained)
            remapped = (length - 1) // group + window - window // group if group > 1 else length - 1
            unseen = unseen_frequencies & (angle > trained_angle)
            rows.append(
                {
                    "length": int(length),
                    "max_angle": angle.tolist(),
                    "angle_ratio_to_trained": (length - 1) / (trained - 1),
                    "unseen_frequencies": int(unseen.sum()),
                    "unseen_fraction": float(unseen.float().mean()),
                    "compensated_group": group,
                    "compensated_max_distance": int(remapped),
                    "compensated_unseen_frequencies": int(
                        (unseen_frequencies & (remapped * inv_freq > trained_angle)).sum()
                    ),
                }
            )
        result["rope"][name] = {
            "theta": inv_freq.tolist(),
            "trained_max_angle": trained_angle.tolist(),
            "by_length": rows,
        }
    return result


def run_diagnostics(
    model: Any, tokenizer: Any, text: str, lengths: Sequence[int], methods: Sequence[str] = ()
) -> dict[str, Any]:
    """All three measurements on ``text`` (repeated to reach ``max(lengths)`` tokens); JSON-able.

    ``methods``: kvweave cache specs to repeat the entropy measurement with (e.g. ``["dkcache"]``).
    """
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2:
        raise ValueError(f"run_diagnostics: lengths must be >= 2 tokens, got {list(lengths)}")
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("run_diagnostics: the text has no tokens")
    ids = ids.repeat(1, -(-lengths[-1] // ids.shape[1]))[:, : lengths[-1]]
    device = next(model.parameters()).device
    ids = ids.to(device)
    return {
        "model": getattr(model.config, "name_or_path", "") or type(model).__name__,
        "trained_length": _trained_length(model),
        "lengths": lengths,
        "key_similarity": key_similarity_by_distance(model, ids),
        "entropy": [entropy_by_length(model, ids, lengths)]
        + [entropy_by_length(model, ids, lengths, method=m) for m in methods],
        "rope_phase": rope_phase_range(model, lengths),
    }
