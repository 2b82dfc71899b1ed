#!/usr/bin/env bash
# The README's first command: set up .venv, then train baseline, doubled batch and R-Drop on
# the committed LibreOffice help corpus (real German-English text) and print test BLEU and a
# plot. Extra arguments go to rdrop_fairseq/recipes/libreoffice_demo.py (e.g. --quick, --seeds 1 2).
# The toy demo of earlier versions: .venv/bin/python -m experiments.toy_demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m rdrop_fairseq.recipes.libreoffice_demo "$@"
