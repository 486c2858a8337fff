"""``kvweave methods``: every registered method, its capabilities and options."""

from __future__ import annotations

import argparse
import json


def cmd_methods(args: argparse.Namespace) -> int:
    import kvweave.methods  # noqa: F401
    from kvweave.registry import METHODS

    infos = [cls.describe() for _, cls in sorted(METHODS.items())]
    if args.markdown:
        from kvweave.report.methods_table import methods_markdown

        print(methods_markdown(), end="")
        return 0
    if args.json:
        print(json.dumps(infos, indent=2, default=str))
        return 0
    for info in infos:
        caps = ", ".join(k for k, v in info["capabilities"].items() if v) or "-"
        print(f"{info['name']:<12} {info['summary']}  [{caps}]")
        for opt in info["options"]:
            allowed = f" (allowed: {opt['range']})" if opt["range"] else ""
            print(
                f"    {opt['name'] + '=' + str(opt['default']):<28} {opt['type']:<14} {opt['help']}{allowed}"
            )
        print(f"    vLLM: {info['vllm']}")
        if info["tuning"]:
            names = ", ".join(opt["name"] for opt in info["tuning"])
            print(
                f"    tuning (implementation settings for experiments and tests; --json explains them): {names}"
            )
    return 0
