"""``kvweave generate``: a reply with a compressed cache (optionally saved or loaded), and the KV bytes held."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvweave.cli_args import _check_generate_length, _load, _loaded_cache, _prompt_text, _verify_saved


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kvweave._compat import cache_kwarg
    from kvweave.cache import make_cache
    from kvweave.prompt import chat_ids
    from kvweave.registry import parse_method

    if args.save_cache and args.load_cache:
        raise ValueError("give --save-cache or --load-cache, not both")
    method = args.method or "full"
    parse_method(method)  # fail on a bad spec before loading a model
    if args.save_cache and Path(args.save_cache).is_file():
        raise ValueError(
            f"--save-cache {args.save_cache} is a file; give a folder (new, or one an earlier save wrote)"
        )
    if args.load_cache:
        from kvweave.distributed import saved_method as saved_spec

        saved_method = saved_spec(args.load_cache)  # one process's cache folder or a tensor-parallel set
        _verify_saved(args.load_cache)  # checksums: a corrupt file fails before the model loads
        if args.method and parse_method(args.method).spec() != saved_method:
            raise ValueError(
                f"--method {args.method} differs from the saved cache's method {saved_method}; drop --method "
                "(the saved one is used) or prefill again with --save-cache"
            )
    if args.prompt and args.prompt_file:
        raise ValueError("give a prompt or --prompt-file, not both")
    if args.prompt_file:
        prompt = _prompt_text(args.prompt_file)
    elif args.prompt and args.prompt.strip():
        prompt = args.prompt
    else:
        raise ValueError('give a prompt: kvweave generate "your prompt" (or --prompt-file FILE)')
    from kvweave.distributed import is_main_process, summed_full_kv_bytes, summed_nbytes
    from kvweave.launch import launch, needs_launch

    if needs_launch(args.tp):  # --tp N: start N ranks under torchrun, each running this command
        return launch(args.argv, args.tp, args.model)
    model, tokenizer = _load(args)
    ids = chat_ids(tokenizer, prompt, chat=not args.raw)
    _check_generate_length(model, ids.shape[1], args.max_new_tokens, args.beyond_trained)
    if args.load_cache:
        cache = _loaded_cache(args.load_cache, model, ids)
    else:
        cache = make_cache(method, model, tokenizer=tokenizer)
    if args.save_cache:
        if ids.shape[1] < 2:
            raise ValueError("--save-cache needs a prompt of at least 2 tokens; give a longer prompt")
        from kvweave.distributed import save_cache  # one file set per rank under tensor parallelism

        with torch.no_grad():  # the prompt but its last token: generate() runs that one and goes on
            model(ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), **{cache_kwarg(model): cache})
        save_cache(cache, model, args.save_cache, prompt_ids=ids[:, :-1])
        if is_main_process():
            print(
                f"saved the cache of {ids.shape[1] - 1} prompt tokens to {args.save_cache}", file=sys.stderr
            )
    extra: dict[str, Any] = {}
    processor = None
    if args.entropy_control:
        from transformers import LogitsProcessorList

        from kvweave.sampling import EntropyTemperatureProcessor

        processor = EntropyTemperatureProcessor()
        extra = {"logits_processor": LogitsProcessorList([processor]), "do_sample": True}
    else:
        extra = {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **extra,
            **{cache_kwarg(model): cache},
        )
    full, held = summed_full_kv_bytes(cache), summed_nbytes(cache)  # every rank takes part under --tp
    if not is_main_process():  # the ranks generated the same tokens; rank 0 prints them
        return 0
    print(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    print(
        f"\n[{cache.method.spec()}] prompt {ids.shape[1]} tokens, KV held {held / 2**20:.2f} MiB, "
        f"16-bit full cache {full / 2**20:.2f} MiB, compression {full / held if held else 0:.2f}x",
        file=sys.stderr,
    )
    if processor is not None:
        trace = processor.trace
        print(json.dumps({"entropy_trace": trace}, default=float), file=sys.stderr)
    return 0
