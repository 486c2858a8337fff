"""Markdown tables for docs/vllm.md from the JSON that ``benchmarks/vllm_bench.py`` wrote (docs/data/vllm/).

python benchmarks/vllm_tables.py docs/data/vllm
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vllm_bench import agreement, summary_rows  # noqa: E402


def load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def capacity(folder: Path) -> list[str]:
    base = load(folder, "qwen-generate-none-bfloat16")
    if base is None:
        return ["(no run)"]
    lines = ["| backend | KV tokens vLLM reports | blocks | x vLLM's |", "| --- | ---: | ---: | ---: |"]
    for name, label in [("qwen-generate-none-bfloat16", "vLLM CPU_ATTN (bf16)")] + [
        (f"qwen-generate-quant{b}-bfloat16", f"kvweave quant:bits={b}") for b in (8, 4, 2)
    ]:
        run = load(folder, name)
        if run is not None:
            ratio = run["kv_tokens"] / base["kv_tokens"]
            lines.append(f"| {label} | {run['kv_tokens']:,} | {run['num_blocks']:,} | {ratio:.3f}x |")
    return lines


def greedy(folder: Path, reference: str, candidates: list[str], tie: float = 0.5) -> list[str]:
    ref = load(folder, reference)
    if ref is None:
        return ["(no run)"]
    lines = [
        "| run | tokens matching vLLM before the first mismatch (per prompt, of 24) | vLLM's top-2 gap there (nats) |",
        "| --- | --- | --- |",
    ]
    for name in candidates:
        run = load(folder, name)
        if run is None:
            continue
        result = agreement(ref, run, tie)
        matched = ", ".join(str(p["matched"]) for p in result["prompts"])
        gaps = ", ".join(
            "-" if p["mismatch_gap"] is None else f"{p['mismatch_gap']:.4f}" for p in result["prompts"]
        )
        lines.append(f"| {run['method']} ({run['dtype']}) | {matched} | {gaps} |")
    return lines


def passkey(folder: Path, name: str) -> list[str]:
    run = load(folder, name)
    if run is None:
        return ["(no run)"]
    lines = [
        f"accuracy **{run['accuracy']:.3f}** ({sum(r['score'] for r in run['rows']):.0f}/{len(run['rows'])})"
    ]
    if "decode_blocks_read_fraction" in run:
        stats = run["stats"]
        lines.append(
            f"; decode read {stats['blocks_read']:,} of {stats['blocks_held']:,} held blocks "
            f"(**{run['decode_blocks_read_fraction']:.3f}**), plus the summaries of {stats['summary_blocks_read']:,} "
            "far blocks (1/128 of a block each)"
        )
    if run.get("server_kv_line"):
        lines.append(f"; server log: `{run['server_kv_line'][0].split('] ')[-1]}`")
    lines.append(
        "\n\n| trial | prompt tokens | answer | prediction | score |\n| ---: | ---: | --- | --- | ---: |"
    )
    for row in run["rows"]:
        text = row["prediction"].replace("\n", " ").replace("|", "/")[:40]
        lines.append(
            f"\n| {row['trial']} | {row['prompt_tokens']} | {row['answers'][0]} | `{text}` | {row['score']:.0f} |"
        )
    return ["".join(lines), "", f"Command: `{run['command']}`"]


def tasks(folder: Path) -> list[str]:
    """Accuracy per method and task from ``serve-passkey --task`` runs, with the KV tokens the server reported."""
    rows = summary_rows(folder)
    if not rows:
        return ["(no run)"]
    task_names = sorted({r["task"] for r in rows})
    lines = [
        "| method | KV tokens the server reported | " + " | ".join(task_names) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in task_names) + " |",
    ]
    for method in sorted({r["method"] for r in rows}):
        mine = {r["task"]: r for r in rows if r["method"] == method}
        tokens = next((f"{r['kv_tokens']:,}" for r in mine.values() if r["kv_tokens"]), "?")
        cells = [
            "-" if task not in mine else f"{100 * mine[task]['score']:.0f} % of {mine[task]['trials']}"
            for task in task_names
        ]
        lines.append(f"| `{method}` | {tokens} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/data/vllm")
    print("## capacity\n" + "\n".join(capacity(folder)))
    print(
        "\n## greedy float32\n"
        + "\n".join(greedy(folder, "qwen-generate-none-float32", ["qwen-generate-quant8-float32"]))
    )
    print(
        "\n## greedy bfloat16\n"
        + "\n".join(
            greedy(
                folder, "qwen-generate-none-bfloat16", [f"qwen-generate-quant{b}-bfloat16" for b in (8, 4, 2)]
            )
        )
    )
    print("\n## http\n" + "\n".join(passkey(folder, "qwen-http-passkey-4k-quant4")))
    print(
        "\n## pages (run under its former name dkcache)\n"
        + "\n".join(passkey(folder, "qwen-passkey-8k-dkcache"))
    )
    print("\n## depthweave against quant:bits=2 at 4K\n" + "\n".join(tasks(folder / "depthweave-4k")))


if __name__ == "__main__":
    main()
