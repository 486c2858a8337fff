#!/usr/bin/env bash
# GPU check for a lent CUDA machine (sized for one H200): the Triton kernel tests compiled for the GPU, then
# `kvweave bench` decode speed on random llama-3.1-8b weights in bfloat16. Ends within 8 minutes.
#
# Usage (from anywhere; it cds to the repository root):   OUT=/some/dir benchmarks/gpu_check.sh
#
# Needs no network and nothing outside the repository (no model download: --shape builds random weights):
# `python` must already have torch (a CUDA build), triton and kvweave's dependencies (transformers, safetensors,
# gguf, numpy, tqdm, accelerate). kvweave itself is installed with `pip install -e . --no-deps
# --no-build-isolation` when it is not importable, or else put on PYTHONPATH from src/.
#
# Stages, each under `timeout`, all inside a deadline of GPU_CHECK_SECONDS (default 470 s) from the start:
#   1. environment (nvidia-smi, versions)                          -> $OUT/env.log                 (<= 30 s)
#   2. pip install -e . --no-deps if kvweave is not importable      -> $OUT/install.log             (<= 90 s)
#   3. python -m pytest -q tests/kernels, TRITON_INTERPRET unset,
#      so the kernels are compiled for the GPU (float32 + bf16/fp16) -> $OUT/kernel-tests.log, .xml  (<= 200 s)
#   4. kvweave bench --shape llama-3.1-8b --device cuda --dtype bfloat16 --methods full,quant,dkcache,depthweave
#      --steps 8 --rounds 3, one process per point, cheapest first: 32k x 1, 64k x 1, 32k x 8, 64k x 8
#      (a point that runs out of memory or time does not cost the points before it; the bench holds every
#      method's cache at once, so 64k x 8 may not fit)                -> $OUT/bench-h200.jsonl (one JSON row
#      per method and point, appended as each point finishes), $OUT/bench-<context>-b<batch>.log
#   $OUT/summary.txt: one line per stage with its exit status and seconds (124: timed out).
# Exit status: the kernel tests' status when they fail; else 0 when every bench point finished, 3 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
BUDGET="${GPU_CHECK_SECONDS:-470}"
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

left() { echo $((BUDGET - (SECONDS - START))); }

# stage NAME LIMIT LOG COMMAND...: run COMMAND under timeout min(LIMIT, time left - 5 s), output to LOG
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local budget
  budget=$(($(left) - 5))
  if [ "$budget" -lt "$limit" ]; then limit=$budget; fi
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped (deadline)" | tee -a "$SUMMARY"
    return 125
  fi
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - began)) s (limit $limit s) -> $(basename "$log")" | tee -a "$SUMMARY"
  return $rc
}

stage environment 30 "$OUT/env.log" bash -c '
  nvidia-smi || echo "nvidia-smi: not available"
  python - <<EOF
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
from importlib import metadata
for name in ("triton", "transformers", "safetensors", "gguf", "accelerate", "kvweave"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "MISSING")
EOF'

if ! python -c "import kvweave" >/dev/null 2>&1; then
  if ! stage install 90 "$OUT/install.log" python -m pip install -e . --no-deps --no-build-isolation; then
    echo "install: failed; using PYTHONPATH=src" | tee -a "$SUMMARY"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

stage kernel-tests 200 "$OUT/kernel-tests.log" env -u TRITON_INTERPRET \
  python -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml" tests/kernels
tests=$?

bench_failed=0
points=("32k 1" "64k 1" "32k 8" "64k 8")
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "bench: skipped (torch sees no CUDA device)" | tee -a "$SUMMARY"
  points=()
  bench_failed=1
fi
for point in "${points[@]}"; do
  set -- $point
  stage "bench $1 x $2" 400 "$OUT/bench-$1-b$2.log" python -c \
    'import sys; from kvweave.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --shape llama-3.1-8b --device cuda --dtype bfloat16 --context "$1" --batch "$2" \
    --methods full,quant,dkcache,depthweave --steps 8 --rounds 3 --out "$OUT/bench-h200.jsonl" ||
    bench_failed=1
done

rows=0
if [ -f "$OUT/bench-h200.jsonl" ]; then rows=$(wc -l <"$OUT/bench-h200.jsonl"); fi
echo "total: $((SECONDS - START)) s; bench rows: $rows" | tee -a "$SUMMARY"
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
if [ "$bench_failed" -ne 0 ]; then exit 3; fi
exit 0
