#!/usr/bin/env bash
# Create .venv with torch (CPU, pinned), a working fairseq, this plugin, the recipes' and
# the tests' dependencies, and tensorboardX (fairseq's --tensorboard-logdir).
# Idempotent: a second run only checks. Override the interpreter with PYTHON=..., the
# environment with VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=$(realpath -m "${VENV:-.venv}")
FAIRSEQ_WHEEL=${FAIRSEQ_WHEEL:-ve-fairseq==0.12.3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# one interpreter start both checks and reports (importing fairseq takes seconds, and
# every script runs this); from / so that the repository's own rdrop_fairseq/ does not
# count as installed
check() {
  (cd / && "$VENV/bin/python" -) <<'PY'
import matplotlib  # before fairseq, whose import sets the root logger to DEBUG
import fairseq, numpy, torch, rdrop_fairseq
import pytest, rouge_score, sacremoses, safetensors, sentencepiece, subword_nmt
import tensorboardX, tokenizers, triton, xdist
print(f"[setup] ok: torch {torch.__version__}, fairseq {fairseq.__version__}, "
      f"numpy {numpy.__version__}, rdrop_fairseq {rdrop_fairseq.__version__}")
PY
}
if ! report=$(check 2>/dev/null); then
  echo "[setup] installing torch (CPU), fairseq and rdrop-fairseq into $VENV"
  "${PIP[@]}" -r requirements/torch-cpu.txt
  "${PIP[@]}" -r requirements/fairseq.txt
  "${PIP[@]}" --no-deps "$FAIRSEQ_WHEEL"
  "${PIP[@]}" -e ".[test,recipes,tensorboard]"
  report=$(check)
fi
echo "$report"
