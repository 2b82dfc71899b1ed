#!/usr/bin/env bash
# The README's second command: set up .venv if needed, then run the whole test suite.
# Extra arguments go to pytest (e.g. -k criteria, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
