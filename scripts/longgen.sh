#!/usr/bin/env bash
# Issue #30's long-generation table: NIAH multi-key at 2K, then 1K / 4K / 8K teacher-forced generated tokens,
# then the question, qwen2.5-coder-0.5b, 6 trials, every baseline (docs/results.md, "2K tokens"). Hours on 2 CPUs:
# every step resumes (finished rows are skipped, a batch killed mid-feed goes on from its last checkpoint), so
# rerun it until it prints "longgen: complete". Rows go to runs/longgen-2k-{1k-batch6,4k-v5,8k-v5}; a folder
# missing there starts from the committed rows in docs/data/runs (the same samples). Copy the rows back to
# docs/data/runs and regenerate docs/results.md to publish them.
# Each column keeps the word lists its committed rows drew from: the 1K column the built-in lists
# (KVWEAVE_DATA unset), the 4K and 8K columns ../shared/data's (KVWEAVE_DATA set); a resume with the other
# lists is refused by kvweave eval.
#   LONGGEN_ONLY=1k|4k|8k (one column)   LONGGEN_METHODS (comma-separated specs; default every method below)
#   LONGGEN_OUT (with LONGGEN_ONLY): another run folder for that column, started empty (the same samples: they
#     follow --seed). For today's default (spec version 9), which the folders' "depthweave" rows (spec version 5)
#     refuse: LONGGEN_ONLY=4k LONGGEN_OUT=runs/longgen-2k-4k-v9 LONGGEN_METHODS=depthweave
#   KVWEAVE (default .venv/bin/kvweave)   SHARED_DATA (default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${LONGGEN_OUT:-}" ] && [ -z "${LONGGEN_ONLY:-}" ]; then
  echo "longgen: LONGGEN_OUT is one column's folder: set LONGGEN_ONLY=1k, 4k or 8k as well" >&2
  exit 2
fi
KVWEAVE=${KVWEAVE:-.venv/bin/kvweave}
SHARED_DATA=${SHARED_DATA:-../shared/data}
# DepthWeave: spec version 8's default is the rows written as depthweave:recall=8 (spec version 7; the version-7
# default's are depthweave:protect_records=6), spec version 9's 1K cell the rows written as
# depthweave:quote=3,quote_after=16 (spec version 8); the folders' "depthweave" rows are the version-5 default
# (protect_names=0, protect_records=0, recall=0), which a resume with today's "depthweave" refuses as another
# configuration: today's default's 4K and 8K cells go to new folders (LONGGEN_OUT above).
METHODS=${LONGGEN_METHODS:-full,quant,dkcache,xkv,snapkv,h2o}

column() {  # column NAME GENERATED DATA(builtin|shared)
  local name=$1 generated=$2 data=$3 out=runs/longgen-2k-$1
  if [ -n "${LONGGEN_ONLY:-}" ] && [ "${name%%-*}" != "$LONGGEN_ONLY" ]; then return; fi
  if [ -n "${LONGGEN_OUT:-}" ]; then
    out=$LONGGEN_OUT
  elif [ ! -d "$out" ] && [ -d "docs/data/runs/longgen-2k-$name" ]; then
    mkdir -p "$out" && cp "docs/data/runs/longgen-2k-$name/rows.jsonl" "$out/"
  fi
  echo "longgen: $generated generated tokens -> $out ($(date +%T))"
  local env=(env -u KVWEAVE_DATA)
  if [ "$data" = shared ]; then env=(env "KVWEAVE_DATA=$SHARED_DATA"); fi
  "${env[@]}" HF_HUB_OFFLINE=1 nice "$KVWEAVE" eval --model qwen2.5-coder-0.5b --task niah_multikey --context 2048 \
    --generated "$generated" --trials 6 --methods "$METHODS" --batch 6 --out "$out"
}

column 1k-batch6 1024 builtin
column 4k-v5 4096 shared
column 8k-v5 8192 shared
echo "longgen: complete ($(date +%T))"
