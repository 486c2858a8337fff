#!/usr/bin/env bash
# Copy finished run folders (rows.jsonl or ppl.jsonl, config.json, command.txt) into docs/data/runs and regenerate
# docs/results.md, docs/report.html and docs/data/summary.csv from them. Usage: benchmarks/publish_results.sh runs/NAME [runs/NAME...]
set -euo pipefail
cd "$(dirname "$0")/.."
for run in "$@"; do
  name=$(basename "$run")
  mkdir -p "docs/data/runs/$name"
  for file in rows.jsonl ppl.jsonl config.json command.txt; do
    if [ -f "$run/$file" ]; then cp "$run/$file" "docs/data/runs/$name/"; fi
  done
done
.venv/bin/kvweave report docs/data/runs/* -o docs/report.html --md docs/results.md --csv docs/data/summary.csv
