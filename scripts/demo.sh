#!/usr/bin/env bash
# The README's first command: set up .venv, then train baseline and R-Drop on a generated
# toy translation task and print their BLEU. Extra arguments go to scripts/toy_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/toy_demo.py "$@"
