"""What the tensor-parallel tests measure, run twice: in one process (the reference, inside pytest) and on 2 gloo
ranks, launched by the test as ``python -m torch.distributed.run --standalone --nproc-per-node=2 tp_scenarios.py
MODEL_FOLDER WORK_FOLDER``; rank 0 writes the ranks' results to ``WORK_FOLDER/tp.json``.

Per method spec: the prefix pattern (prefill a context into the cache, then ``generate`` with context + question),
its greedy tokens and logits, the bytes held (this rank's and summed over the ranks) and the rank ``stats()``
names. Per registered method, under tensor parallelism: a per-rank save and load continues exactly. DepthWeave's
recall on a stream that copies its prompt (teacher-forced, one id a step): the spans it rebuilds and their keys. And
what loading a one-process cache file into the ranks says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from kvweave import distributed
from kvweave._compat import cache_kwarg
from kvweave.cache import tensors_nbytes
from kvweave.registry import METHODS, parse_method

NAMES = sorted(METHODS)
# decisions that are all-reduced over the ranks, beyond what the registry's test options exercise
EXTRA_SPECS = [
    "dkcache:core=4,steady=16,page=8,pages=2,sinks=2,far_dtype=int8,retrieve=entropy,entropy_threshold=0.9",
    "depthweave:recent=8,block=8,group=2,compression=3.0,probe=4,window=8,sinks=2,decode_tokens=8,page=4,"
    "router=True,evict=0.25",
    "depthweave:recent=8,block=8,group=2,target_error=0.05,probe=4,sinks=2,decode_tokens=0",
    # the recent window grows within the 6 new tokens (its size is agreed over the ranks)
    "depthweave:recent=1,block=1,group=2,compression=1.5,probe=4,window=8,sinks=2,decode_tokens=8,page=4,"
    "recent_share=0.9",
    # the window passes recent + half a block and its older tokens move to the 4-bit middle tier (100 new tokens)
    "depthweave:recent=1,block=4,group=2,compression=2.0,probe=4,window=8,sinks=2,decode_tokens=8,page=4,"
    "recent_share=0.9,middle_bits=4",
]
NEW_TOKENS = 6
LONGER = {EXTRA_SPECS[-1]: 100}
"""Specs whose decisions need more new tokens than :data:`NEW_TOKENS` (by the spec as written above)."""
# what each layer's stats say a method decided: entries held, DepthWeave's probe-chosen ranks and refreshes,
# DK-Cache's tiers and retrievals (under tensor parallelism every rank must report the same)
DECISIONS = (
    "entries",
    "middle_tokens",
    "budget",
    "rank_k",
    "rank_v",
    "folds",
    "refreshes",
    "tokens",
    "tiers",
    "retrieval_steps",
)


# recall: a stream that copies its prompt, fed one id a step after the prefill; held at 4 bits (the default) and at
# 16 bits (whose rebuilt keys each rank can compare with one process's heads)
RECALL_SPECS = [
    parse_method(
        f"depthweave:recent=8,block=8,group=2,compression=3.0,probe=4,window=8,sinks=2,recall=4{bits}"
    ).spec()
    for bits in ("", ",recall_bits=16")
]


def spec_of(name: str) -> str:
    """The spec of registered method ``name`` with its test options (small budgets for a 55-token prompt)."""
    return parse_method(name, **METHODS[name].test_options).spec()


SPECS = [spec_of(name) for name in NAMES] + [parse_method(spec).spec() for spec in EXTRA_SPECS]


def save_tiny_model(folder: Path, config: Any) -> Path:
    """Save a seeded random model of ``config`` and a character-level tokenizer (printable ASCII, so any task's
    text encodes) as a Hugging Face folder that ``kvweave.load_model`` and the CLI read."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.save_pretrained(folder)
    characters = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *characters])}
    assert len(vocab) <= config.vocab_size
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    return folder


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """``(context [1, 48], context + question [1, 55])`` token ids (seeded)."""
    generator = torch.Generator().manual_seed(2)
    context = torch.randint(3, 150, (1, 48), generator=generator)
    question = torch.randint(3, 150, (1, 7), generator=generator)
    return context, torch.cat([context, question], dim=1)


def continue_greedy(
    model: Any, cache: Any, ids: torch.Tensor, new_tokens: int = NEW_TOKENS
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and ``[steps, vocab]`` logits of ``generate`` continuing ``cache`` with ``ids``."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **{cache_kwarg(model): cache},
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits).float()


def prefix_pattern(model: Any, spec: str) -> dict[str, Any]:
    """The prefix pattern with ``spec``: tokens, logits (prefill's last and generated), bytes, stats' rank."""
    context, full = prompt()
    cache = kvweave.make_cache(spec, model)
    with torch.no_grad():
        prefill = model(context, **{cache_kwarg(model): cache}).logits[0, -1].float()
    longer = {parse_method(written).spec(): count for written, count in LONGER.items()}
    tokens, logits = continue_greedy(model, cache, full, longer.get(spec, NEW_TOKENS))
    stats = cache.stats()
    decisions = [{key: layer[key] for key in DECISIONS if key in layer} for layer in stats["layers"]]
    return {
        "decisions": decisions,
        "tokens": tokens,
        "logits": torch.cat([prefill.view(1, -1), logits]).tolist(),
        "nbytes": cache.nbytes(),
        # what the method holds beside its layers (DepthWeave's recall: the token ids), every rank a copy
        "context_bytes": tensors_nbytes(cache.method.context_tensors(cache.context)),
        "summed_nbytes": distributed.summed_nbytes(cache),
        "summed_full_kv_bytes": distributed.summed_full_kv_bytes(cache),
        "kv_heads": cache.num_kv_heads,
        "tp_rank": stats.get("tp_rank"),
        "tp_size": stats.get("tp_size"),
    }


def save_and_load(model: Any, spec: str, folder: Path) -> dict[str, Any]:
    """Prefill, save (per rank under tensor parallelism), load into a fresh cache: do both continue alike?"""
    context, full = prompt()
    cache = kvweave.make_cache(spec, model)
    with torch.no_grad():
        model(context, **{cache_kwarg(model): cache})
    distributed.save_cache(cache, model, folder, prompt_ids=context)
    loaded, manifest = distributed.load_cache(folder, model)
    original_tokens, original_logits = continue_greedy(model, cache, full)
    loaded_tokens, loaded_logits = continue_greedy(model, loaded, full)
    return {
        "same_tokens": original_tokens == loaded_tokens,
        "same_logits": bool(torch.equal(original_logits, loaded_logits)),
        "manifest_tokens": manifest.tokens,
    }


def copy_stream() -> torch.Tensor:
    """The prompt's 48 ids, 150 other ids, then the prompt's ids 4..43 again (a copy a decode step can match)."""
    context, _ = prompt()
    other = torch.randint(3, 150, (1, 150), generator=torch.Generator().manual_seed(3))
    return torch.cat([context, other, context[:, 4:44]], dim=1)


def recall_copy(model: Any, spec: str) -> dict[str, Any]:
    """Prefill the prompt, feed the rest of :func:`copy_stream` one id a step: the spans recall rebuilt, every
    layer's slots held at the end (the copy goes on), layer 0's rebuilt keys (16-bit spans) and the logits."""
    stream = copy_stream()
    cache = kvweave.make_cache(spec, model)
    kw = {cache_kwarg(model): cache}
    logits = []
    with torch.no_grad():
        model(stream[:, :48], **kw)
        for t in range(48, stream.shape[1]):
            logits.append(model(stream[:, t : t + 1], **kw).logits[0, -1].float())
    held = [layer.recall.get(0) for layer in cache.layers]
    first = held[0]
    return {
        "rebuilds": cache.context.decode_state.rebuilds,
        "slots": [None if h is None else h[-1].tolist() for h in held],
        "keys": first[0].float().tolist() if first is not None and len(first) == 3 else None,
        "logits": torch.stack(logits).tolist(),
        "nbytes": cache.nbytes(),
    }


def refusal(action: Any) -> str | None:
    """The message of the ``CacheFileError`` that ``action()`` raises (``None`` if it raises none)."""
    from kvweave.persist import CacheFileError

    try:
        action()
    except CacheFileError as error:
        return str(error)
    return None


def main(model_folder: str, work: str) -> None:
    """Run every scenario on this rank; rank 0 writes ``work/tp.json``."""
    torch.set_num_threads(1)
    model, _ = kvweave.load_model(model_folder, tp_plan="auto")
    tp = distributed.tensor_parallel(model)
    assert tp is not None, "the model was not sharded"
    results: dict[str, Any] = {"prefix": {spec: prefix_pattern(model, spec) for spec in SPECS}}
    results["per_rank"] = {}
    for spec, measured in results["prefix"].items():  # every rank's own bytes and decisions
        ranks: list[Any] = [None] * tp.size
        torch.distributed.all_gather_object(
            ranks, [measured["nbytes"], measured["decisions"]], group=tp.group
        )
        results["per_rank"][spec] = {"nbytes": [r[0] for r in ranks], "decisions": [r[1] for r in ranks]}
    results["recall"] = {}
    for spec in RECALL_SPECS:  # every rank's own rebuilt keys (its heads)
        measured = recall_copy(model, spec)
        ranks = [None] * tp.size
        torch.distributed.all_gather_object(ranks, measured, group=tp.group)
        results["recall"][spec] = ranks
    saves = Path(work) / "tp-saves"
    results["save_load"] = {name: save_and_load(model, spec_of(name), saves / name) for name in NAMES}
    results["one_process_file"] = refusal(lambda: distributed.load_cache(Path(work) / "one-process", model))
    if distributed.is_main_process():
        (Path(work) / "tp.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
