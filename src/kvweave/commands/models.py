"""``kvweave models [list|pull NAME]``: the registry's offline models, or install one."""

from __future__ import annotations

import argparse
import json


def cmd_models(args: argparse.Namespace) -> int:
    from kvweave import models

    if args.action == "pull":
        if not args.name:
            raise ValueError("give a model name: kvweave models pull NAME (see `kvweave models`)")
        folder = models.pull(args.name, progress=True)
        print(f"{args.name}: ready in {folder}")
        return 0
    rows = models.list_models()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(f"{'name':<22} {'arch':<8} {'context':>8} {'size':>10}  {'installed':<9} {'converted':<9}")
    for r in rows:
        print(
            f"{r['name']:<22} {r['architecture']:<8} {r['trained_context']:>8} {r['size']:>10}  "
            f"{str(r['installed']):<9} {str(r['converted']):<9}"
        )
    return 0
