#!/usr/bin/env bash
# The README's second command: set up .venv if needed, then run the whole test suite.
# Extra arguments go to pytest (e.g. tests/test_core.py, -k criteria, -x; -n 0: one process).
# The tests run on every core (pytest-xdist), a test file per worker: most of them wait on
# single-threaded fairseq runs, and a file's tests share its module fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# testpaths (pytest.ini): tests/ and experiments/tests/
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-auto}" --dist loadfile "$@"
