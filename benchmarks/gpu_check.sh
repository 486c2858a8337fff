#!/usr/bin/env bash
# GPU check for a lent CUDA machine (sized for one H200): the Triton kernel tests compiled for the GPU (float32,
# float16, bfloat16) against their torch references, then `kvweave bench` decode speed of the Triton-wired methods
# on random llama-3.1-8b weights in bfloat16. Ends within 8 minutes and writes one JSON.
#
# Usage (from anywhere; it cds to the repository root):   OUT=/some/dir benchmarks/gpu_check.sh
# Dry run on a CPU (CI runs it: the same stages on a tiny random model, the kernels under TRITON_INTERPRET=1):
#                                                          GPU_CHECK_DRY=1 OUT=/some/dir benchmarks/gpu_check.sh
#
# Needs no network and nothing outside the repository (no model download: --shape builds random weights):
# PYTHON (default: python, else python3) must already have torch (a CUDA build), triton and kvweave's dependencies
# (transformers, safetensors, gguf, numpy, tqdm, accelerate). kvweave itself is installed with `pip install -e .
# --no-deps --no-build-isolation` when it is not importable, or else put on PYTHONPATH from src/.
#
# Stages, each under `timeout`, all inside a deadline of GPU_CHECK_SECONDS (default 470 s) from the start:
#   1. environment (nvidia-smi, versions)                          -> $OUT/env.log                 (<= 30 s)
#   2. pip install -e . --no-deps if kvweave is not importable      -> $OUT/install.log             (<= 90 s)
#   3. pytest tests/kernels with TRITON_INTERPRET unset, so the kernels are compiled for the GPU (float32 and
#      bf16/fp16 against their torch references; each method driven through generate() on both backends)
#                                                                   -> $OUT/kernel-tests.log, .xml  (<= 200 s)
#   4. kvweave bench --shape llama-3.1-8b --device cuda --dtype bfloat16 --steps 8 --rounds 5
#      --methods full,quant:bits=4,dkcache,depthweave, one process per point: 64k x 1, then 16k x 8 (a point
#      that runs out of memory or time does not cost the one before it; the bench holds every method's cache
#      and one recorded prefill at once: under 70 GiB at 16k x 8 beside 16 GiB of weights)
#                                                                   -> $OUT/bench.jsonl, $OUT/bench-<point>.log
#   5. $OUT/gpu-check.json: every stage's line, the kernel tests' counts and every bench row in one file.
#   GPU_CHECK_KERNEL_TESTS names other test paths for stage 3 (CI's dry run: the import test only, since the
#   suite it runs in has run tests/kernels under the interpreter already).
#   $OUT/summary.txt: one line per stage with its exit status and seconds (124: timed out).
#   GPU_CHECK_PACK=1 folds the per-stage logs into $OUT/logs.tar.gz at the end, leaving five files in $OUT
#   (gpu-check.json, summary.txt, bench.jsonl, kernel-tests.xml, logs.tar.gz), for runners that return few files.
# Exit status: the kernel tests' status when they fail; else 0 when every bench point finished, 3 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
BUDGET="${GPU_CHECK_SECONDS:-470}"
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
PYTHON="${PYTHON:-$(command -v python >/dev/null 2>&1 && echo python || echo python3)}"
DRY="${GPU_CHECK_DRY:-0}"
export PYTHON HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
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
  "$PYTHON" - <<EOF
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

if ! "$PYTHON" -c "import kvweave" >/dev/null 2>&1; then
  if ! stage install 90 "$OUT/install.log" "$PYTHON" -m pip install -e . --no-deps --no-build-isolation; then
    echo "install: failed; using PYTHONPATH=src" | tee -a "$SUMMARY"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

if [ "$DRY" = 1 ]; then
  # a CPU: the kernels run under Triton's interpreter (float32), the bench on a tiny random model
  kernel_env=(env TRITON_INTERPRET=1)
  bench_args=(--shape tiny --device cpu --dtype float32 --steps 2 --rounds 2 --warmup 1)
  points=("256 1" "128 2")
else
  kernel_env=(env -u TRITON_INTERPRET)
  bench_args=(--shape llama-3.1-8b --device cuda --dtype bfloat16 --steps 8 --rounds 5)
  points=("64k 1" "16k 8")
fi
stage kernel-tests 200 "$OUT/kernel-tests.log" "${kernel_env[@]}" \
  "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml" ${GPU_CHECK_KERNEL_TESTS:-tests/kernels}
tests=$?

bench_failed=0
if [ "$DRY" != 1 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "bench: skipped (torch sees no CUDA device; GPU_CHECK_DRY=1 runs the CPU dry run)" | tee -a "$SUMMARY"
  points=()
  bench_failed=1
fi
for point in "${points[@]}"; do
  set -- $point
  stage "bench $1 x $2" 300 "$OUT/bench-$1-b$2.log" "$PYTHON" -c \
    'import sys; from kvweave.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench "${bench_args[@]}" --context "$1" --batch "$2" \
    --methods full,quant:bits=4,dkcache,depthweave --out "$OUT/bench.jsonl" ||
    bench_failed=1
done

rows=0
if [ -f "$OUT/bench.jsonl" ]; then rows=$(wc -l <"$OUT/bench.jsonl"); fi
echo "total: $((SECONDS - START)) s; bench rows: $rows" | tee -a "$SUMMARY"
"$PYTHON" - "$OUT" "$DRY" "$tests" "$bench_failed" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, dry, tests, bench_failed = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
counts = {}
xml = out / "kernel-tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = out / "bench.jsonl"
rows = [json.loads(line) for line in bench.read_text().splitlines() if line.strip()] if bench.exists() else []
result = {
    "kind": "gpu_check",
    "dry_run": dry,
    "stages": (out / "summary.txt").read_text().splitlines(),
    "kernel_tests": {"exit": tests, **counts},
    "bench_failed": bool(bench_failed),
    "bench": rows,
}
(out / "gpu-check.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"{out / 'gpu-check.json'}: kernel tests {counts or 'not run'}, {len(rows)} bench rows")
EOF
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  (cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log) && echo "logs: packed into $OUT/logs.tar.gz"
fi
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
if [ "$bench_failed" -ne 0 ]; then exit 3; fi
exit 0
