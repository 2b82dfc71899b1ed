#!/usr/bin/env bash
# Create .venv with torch (CPU, pinned), a working fairseq, this plugin, the recipes' and
# the tests' dependencies, and tensorboardX (fairseq's --tensorboard-logdir).
# Idempotent: a second run only checks, and a run after a passed check only compares a
# stamp (below). Override the interpreter with PYTHON=..., the environment with VENV=...;
# SETUP_CHECK=1 checks even where the stamp matches.
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
import pyarrow, pytest, rouge_score, sacremoses, safetensors, sentencepiece, subword_nmt
import tensorboardX, tokenizers, triton, xdist
print(f"[setup] ok: torch {torch.__version__}, fairseq {fairseq.__version__}, "
      f"numpy {numpy.__version__}, rdrop_fairseq {rdrop_fairseq.__version__}")
PY
}
# The check imports fairseq (about 5 s), and every script runs this. A passed check is
# remembered in $VENV/.setup-ok beside a key of what it depends on: this script, the
# requirement files, setup.py, the interpreter, the installed distributions
# (site-packages' entries, the .pth files of editable installs), this checkout and
# PYTHONPATH. While the key is the same, the saved report stands for the check.
STAMP="$VENV/.setup-ok"
key() {
  {
    printf '%s\n' "$PWD" "${PYTHONPATH:-}" "$FAIRSEQ_WHEEL"
    stat -L -c '%n %Y %s' "$VENV/bin/python"
    cat scripts/setup.sh requirements/*.txt setup.py
    for site in "$VENV"/lib/python*/site-packages; do
      ls -1A "$site"
      stat -c '%n %Y %s' "$site"/*.pth 2>/dev/null || true
    done
  } | sha256sum | cut -d' ' -f1
}
if [ -z "${SETUP_CHECK:-}" ] && [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$(key)" ]; then
  tail -n +2 "$STAMP"
  exit 0
fi
if ! report=$(check 2>/dev/null); then
  echo "[setup] installing torch (CPU), fairseq and rdrop-fairseq into $VENV"
  "${PIP[@]}" -r requirements/torch-cpu.txt
  "${PIP[@]}" -r requirements/fairseq.txt
  "${PIP[@]}" --no-deps "$FAIRSEQ_WHEEL"
  "${PIP[@]}" -e ".[test,recipes,tensorboard]"
  report=$(check)
fi
echo "$report"
# written whole or not at all (two scripts may run this at once); an environment this user
# cannot write to is checked every time
{ key && echo "$report"; } 2>/dev/null >"$STAMP.$$" && mv -f "$STAMP.$$" "$STAMP" ||
  rm -f "$STAMP.$$"
