"""Why DepthWeave loses a retrieval sample: what the factorization does to the needle tokens, per layer group.

For each sample (a real task prompt, question-agnostic: the context is compressed before the question is seen)
and each DepthWeave spec, this script

1. records the exact prefill of the whole prompt (context + question) once, to get every layer's exact
   post-RoPE keys, values and the question's queries;
2. prefills a DepthWeave cache with the context alone and rebuilds, per layer, the keys and values it stores
   (factorized segments dequantized and rotated, exact rows, the recent buffer);
3. writes one JSON line per (sample, spec, layer group) with
   - ``needle_err_k`` / ``needle_err_v``: mean relative reconstruction error ``|x̂ - x| / |x|`` of the answer
     tokens' keys / values (the spans of the sample's answers in the context), ``rest_err_k`` / ``rest_err_v``
     the same over every other compressed token;
   - ``mass_exact`` / ``mass_stored``: attention mass the question's queries put on the answer tokens with the
     exact vs the stored keys (mean over layers, heads and question tokens);
   - ``question_out_err``: relative attention-output error of the question's queries, exact vs stored KV;
     ``question_out_err_needle_exact`` the same with the answer tokens' keys and values exact (an oracle: what
     protecting exactly those tokens would buy);
   - ``needle_kinds``: the token kinds (exact row / hi / mid / lo bucket) the needle tokens were stored as;
   - ``answer_out_err`` (``_needle_exact``): the same for the queries of the gold answer (teacher-forced
     after the question: the queries decode steps make), attending over everything stored;
   - ``kept_mass_P/T`` / ``needle_picked_P/T``: for those answer queries, the share of the exact attention
     mass over the factorized tokens that lies in the pages selective decode would pick with ``page=P`` and
     ``decode_tokens=T`` (``T / P`` pages per KV head by the page bound of ``q·k`` over the stored keys, pages
     in slot order), and the share of needle tokens picked; mean over layers, heads and answer tokens. At the
     default (64/512) also with ``page_choice=fair`` and ``mass`` (suffixes ``_fair``, ``_mass``), and
     ``pages_picked_*``: the pages each rule took per KV head and query (``mass`` takes up to twice the
     budget's).

Not a test: a diagnosis tool; its output is summarised in docs/findings.md with the command that made it.
Example::

    KVWEAVE_DATA=../shared/data python benchmarks/depthweave_diagnose.py --task niah_multiquery \\
        --haystack essays --context 4096 --trials 0,1 --out runs/dw-diagnose.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval import tasks as task_lib
from kvweave.eval.prefill import LayerStep, record_prefill
from kvweave.eval.runner import build_prompt
from kvweave.methods.depthweave import DensePart, DepthWeaveLayer, FactorPart
from kvweave.methods.depthweave.chunk import EXACT, HI, LO, MID
from kvweave.methods.depthweave.select import choose_pages


def token_offsets(tokenizer: Any, ids: list[int]) -> tuple[str, list[int]]:
    """The decoded text of ``ids`` and each token's start offset in it (token by token)."""
    pieces = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(ids)]
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece)
    return "".join(pieces), starts


def answer_tokens(tokenizer: Any, ids: list[int], answers: list[str]) -> list[int]:
    """Token indices of every occurrence of every answer string in the decoded ``ids``."""
    text, starts = token_offsets(tokenizer, ids)
    ends = starts[1:] + [len(text)]
    found: set[int] = set()
    for answer in answers:
        at = text.find(answer)
        while at >= 0:
            stop = at + len(answer)
            found.update(i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if s < stop and e > at)
            at = text.find(answer, stop)
    return sorted(found)


def stored_kv(layer: DepthWeaveLayer, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``keys, values: [H, n, D]`` float32 as layer ``layer`` stores the first ``n`` tokens (batch row 0), and
    ``kind: [n]`` (EXACT / HI / MID / LO, -1 for the recent buffer)."""
    group = layer.group
    store = group.rows[0]
    rotary = layer.cache.rotary_for(layer.layer_idx) if layer.method.keys == "pre_rope" else None
    heads, dim = store.heads, store.dim
    keys = torch.zeros(heads, n, dim)
    values = torch.zeros(heads, n, dim)
    kind = torch.full((n,), -2, dtype=torch.int64)
    for part in store.attention_parts(layer.layer_idx, rotary):
        if isinstance(part, FactorPart):
            k, v = part.dense()
        else:
            assert isinstance(part, DensePart)
            k, v = part.keys, part.values
        slots = part.slots.long()
        keys[:, slots] = k.float()
        values[:, slots] = v.float()
    widths = layer.method.bucket_widths(store.rank["k"], store.total_rank("k"))
    codes = {widths[LO]: LO, widths[HI]: HI, widths[MID]: MID}  # equal widths (no router): all MID
    for (wk, _wv), segment in store.segments.items():
        kind[segment.slots.long()] = codes.get(wk, MID)
    if store.exact_slots is not None:
        kind[store.exact_slots.long()] = EXACT
    buffer = group.recent[layer.layer_idx]
    if buffer.count():
        first = n - buffer.count()
        keys[:, first:] = buffer.keys[0].float()  # type: ignore[index]
        values[:, first:] = buffer.values[0].float()  # type: ignore[index]
        kind[first:] = -1
    return keys, values, kind


RULES = ("max", "fair", "mass")
"""DepthWeave's ``page_choice`` rules compared at the default page and budget."""
SELECTIONS = ((64, 512), (64, 1024), (64, 2048), (32, 512), (32, 1024), (16, 512), (16, 1024))
"""(page, decode_tokens) settings of selective decode whose page choice is scored."""


def attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_ctx: int, scaling: float
) -> Any:
    """Probabilities ``[Hq, q, N]`` and outputs ``[Hq, q, D]`` of the question's queries (causal over the
    question itself)."""
    hq, q, _ = query.shape
    h = keys.shape[0]
    k = keys.repeat_interleave(hq // h, 0)
    v = values.repeat_interleave(hq // h, 0)
    logits = query @ k.transpose(-1, -2) * scaling
    total = k.shape[1]
    allowed = torch.arange(total).view(1, -1) <= (n_ctx + torch.arange(q)).view(-1, 1)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs, probs @ v


def page_recall(
    queries: torch.Tensor,
    stored: torch.Tensor,
    exact: torch.Tensor,
    needle: torch.Tensor,
    page: int,
    budget: int,
    scaling: float,
    rule: str = "max",
) -> tuple[float, float, float]:
    """Selective decode's page choice for the answer's queries ``[Hq, a, D]`` over the compressed tokens:
    pages of ``page`` stored keys (``stored: [H, c, D]``, in slot order), ``budget / page`` per KV head by the
    upper bound of ``q·k`` under ``rule`` (DepthWeave's ``page_choice``: ``max``, ``fair`` or ``mass``, which
    may take up to twice as many). Returns the fraction of the exact attention mass over the compressed tokens
    inside the picked pages, the fraction of needle tokens (``needle``: boolean ``[c]``) picked, each a mean
    over queries and heads, and the pages picked per KV head and query."""
    hq, a, d = queries.shape
    h, c, _ = stored.shape
    pages = -(-c // page)
    pad = pages * page - c
    padded = torch.cat([stored, stored[:, -1:].expand(h, pad, d)], 1) if pad else stored
    kp = padded.view(h, pages, page, d)
    lo, hi = kp.amin(2), kp.amax(2)  # [H, P, D]
    q = queries.view(h, hq // h, a, 1, d)
    bound = torch.maximum(q * lo[:, None, None], q * hi[:, None, None]).sum(-1)  # [H, g, a, P]
    chosen = min(pages, max(1, budget // page))
    picked = torch.zeros(h, a, pages, dtype=torch.bool)
    for i in range(a):
        top = choose_pages(bound[:, :, i], chosen, rule, scaling)  # [H, k], -1: none
        real = top >= 0
        picked[:, i].scatter_(1, top.clamp(min=0), real)
    picked_tokens = picked.repeat_interleave(page, 2)[..., :c]  # [H, a, c]
    probs = (queries @ exact.repeat_interleave(hq // h, 0).transpose(-1, -2) * scaling).softmax(-1)
    inside = picked_tokens.repeat_interleave(hq // h, 0)
    mass = float((probs * inside).sum(-1).mean())
    hit = float(picked_tokens[..., needle].float().mean()) if needle.any() else float("nan")
    return mass, hit, float(picked.sum(-1).float().mean())


def diagnose(model: Any, tokenizer: Any, sample: task_lib.Sample, spec: str) -> list[dict[str, Any]]:
    prefill_ids, full_ids = build_prompt(tokenizer, sample, question_aware=False)
    n_ctx = len(prefill_ids)
    needle = torch.tensor(answer_tokens(tokenizer, prefill_ids, sample.answers), dtype=torch.long)
    gold = tokenizer.encode(" " + ", ".join(sample.answers), add_special_tokens=False)
    n_full = len(full_ids)
    steps = record_prefill(model, torch.tensor([full_ids + gold]))
    cache = kvweave.make_cache(spec, model)
    cache.set_prompt([prefill_ids], tokenizer)
    with torch.no_grad():
        model(torch.tensor([prefill_ids]), **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    by_group: dict[int, list[dict[str, Any]]] = {}
    for layer in cache.layers:
        if not isinstance(layer, DepthWeaveLayer):
            continue
        step = steps[layer.layer_idx]
        assert isinstance(step, LayerStep)
        exact_k = step.key[0].float()  # [H, N, D]
        exact_v = step.value[0].float()
        keys, values, kind = stored_kv(layer, n_ctx)
        compressed = kind >= 0
        is_needle = torch.zeros(n_ctx, dtype=torch.bool)
        is_needle[needle] = True
        err_k = (keys - exact_k[:, :n_ctx]).norm(dim=-1) / exact_k[:, :n_ctx].norm(dim=-1).clamp_min(1e-9)
        err_v = (values - exact_v[:, :n_ctx]).norm(dim=-1) / exact_v[:, :n_ctx].norm(dim=-1).clamp_min(1e-9)
        err_k, err_v = err_k.mean(0), err_v.mean(0)  # [n]
        rest = compressed & ~is_needle
        query = step.query[0, :, n_ctx:n_full].float()  # [Hq, q, D] the question's queries
        answer_q = step.query[0, :, n_full:].float()  # the gold answer's (teacher-forced) queries
        exact_k, exact_v = exact_k[:, :n_full], exact_v[:, :n_full]
        scaling = float(getattr(step.module, "scaling", query.shape[-1] ** -0.5))
        full_k = torch.cat([keys, exact_k[:, n_ctx:]], 1)
        full_v = torch.cat([values, exact_v[:, n_ctx:]], 1)
        p_exact, o_exact = attention(query, exact_k, exact_v, n_ctx, scaling)
        p_stored, o_stored = attention(query, full_k, full_v, n_ctx, scaling)
        out_err = float(((o_stored - o_exact).norm(dim=-1) / o_exact.norm(dim=-1).clamp_min(1e-9)).mean())
        oracle_k, oracle_v = full_k.clone(), full_v.clone()  # the needle tokens exact, the rest as stored
        oracle_k[:, needle], oracle_v[:, needle] = exact_k[:, needle], exact_v[:, needle]
        _, o_oracle = attention(query, oracle_k, oracle_v, n_ctx, scaling)
        oracle_err = float(((o_oracle - o_exact).norm(dim=-1) / o_exact.norm(dim=-1).clamp_min(1e-9)).mean())
        kinds = {
            name: int((kind[needle] == code).sum())
            for name, code in (("exact", EXACT), ("hi", HI), ("mid", MID), ("lo", LO), ("recent", -1))
        }
        # the answer's queries (decode steps): output error over the stored KV, and with the needles exact
        n_ans = answer_q.shape[1]
        ans_k = torch.cat([full_k, step.key[0, :, n_full:].float()], 1)
        ans_v = torch.cat([full_v, step.value[0, :, n_full:].float()], 1)
        all_k, all_v = step.key[0].float(), step.value[0].float()
        _, a_exact = attention(answer_q, all_k, all_v, n_full, scaling)
        _, a_stored = attention(answer_q, ans_k, ans_v, n_full, scaling)
        ans_oracle_k, ans_oracle_v = ans_k.clone(), ans_v.clone()
        ans_oracle_k[:, needle], ans_oracle_v[:, needle] = all_k[:, needle], all_v[:, needle]
        _, a_oracle = attention(answer_q, ans_oracle_k, ans_oracle_v, n_full, scaling)
        norm = a_exact.norm(dim=-1).clamp_min(1e-9)
        answer_err = float(((a_stored - a_exact).norm(dim=-1) / norm).mean())
        answer_oracle = float(((a_oracle - a_exact).norm(dim=-1) / norm).mean())
        factorized = (kind >= 0) & (kind != EXACT)
        cand = factorized.nonzero().squeeze(1)
        selection = {}
        for page, budget in SELECTIONS:
            if int(cand.numel()) > budget and n_ans:
                # the default's page and budget under every page choice; the other sizes with max
                for rule in RULES if (page, budget) == (64, 512) else ("max",):
                    name = f"{page}/{budget}" + ("" if rule == "max" else f"_{rule}")
                    selection[name] = page_recall(
                        answer_q,
                        keys[:, cand],
                        exact_k[:, cand],
                        is_needle[cand],
                        page,
                        budget,
                        scaling,
                        rule,
                    )
        by_group.setdefault(layer.group.index, []).append(
            {
                "needle_err_k": float(err_k[needle].mean()) if needle.numel() else None,
                "needle_err_v": float(err_v[needle].mean()) if needle.numel() else None,
                "rest_err_k": float(err_k[rest].mean()),
                "rest_err_v": float(err_v[rest].mean()),
                "mass_exact": float(p_exact[..., needle].sum(-1).mean()),
                "mass_stored": float(p_stored[..., needle].sum(-1).mean()),
                "question_out_err": out_err,
                "question_out_err_needle_exact": oracle_err,
                "answer_out_err": answer_err,
                "answer_out_err_needle_exact": answer_oracle,
                **{f"kept_mass_{k}": v[0] for k, v in selection.items()},
                **{f"needle_picked_{k}": v[1] for k, v in selection.items()},
                **{f"pages_picked_{k}": v[2] for k, v in selection.items()},
                "needle_kinds": kinds,
            }
        )
    rows = []
    for index, layers in sorted(by_group.items()):
        row: dict[str, Any] = {"group": index, "layers": len(layers), "needle_tokens": int(needle.numel())}
        for key in layers[0]:
            if key == "needle_kinds":
                row[key] = layers[0][key]
                continue
            vals = [x[key] for x in layers if x[key] is not None and x[key] == x[key]]
            row[key] = round(sum(vals) / len(vals), 4) if vals else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", default="niah_multiquery")
    parser.add_argument("--haystack", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--trials", default="0,1", help="comma-separated trial indices (as kvweave eval's)")
    parser.add_argument(
        "--of", type=int, default=6, help="trials the depths are spread over (kvweave eval's --trials)"
    )
    parser.add_argument(
        "--methods",
        default="depthweave:protect=0;depthweave",
        help="DepthWeave specs, separated by semicolons",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL output (appended)")
    args = parser.parse_args(argv)
    model, tokenizer = kvweave.load_model(args.model)
    depths = task_lib.depths(args.of)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    specs = args.methods.split(";")
    for trial in (int(t) for t in args.trials.split(",")):
        sample = task_lib.make_sample(
            args.task, tokenizer, args.context, depth=depths[trial], seed=trial, haystack=args.haystack
        )
        for spec in specs:
            for row in diagnose(model, tokenizer, sample, spec):
                row.update(task=args.task, context=args.context, trial=trial, method=spec)
                with args.out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
