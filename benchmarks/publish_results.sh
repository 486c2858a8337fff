#!/usr/bin/env bash
# Copy finished run folders (rows.jsonl, config.json, command.txt) into docs/data/runs and regenerate
# docs/results.md, docs/report.html and docs/data/summary.csv from them. Usage: benchmarks/publish_results.sh runs/NAME [runs/NAME...]
set -euo pipefail
cd "$(dirname "$0")/.."
for run in "$@"; do
  name=$(basename "$run")
  mkdir -p "docs/data/runs/$name"
  cp "$run"/rows.jsonl "$run"/config.json "docs/data/runs/$name/"
  [ -f "$run/command.txt" ] && cp "$run/command.txt" "docs/data/runs/$name/"
done
.venv/bin/kvweave report docs/data/runs/* -o docs/report.html --md docs/results.md --csv docs/data/summary.csv
