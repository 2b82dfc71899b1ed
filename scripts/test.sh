#!/usr/bin/env bash
# The README's second command: set up .venv if needed, then run the whole test suite.
# --fast (first argument): the core tier instead: the loss, the criteria, the fused-linear
# path, the Triton kernel (in its interpreter), the loss's edges in every implementation,
# the plain-PyTorch example and AttendOut's units, without the tests that run fairseq's
# command-line tools or AttendOut's 300-pruning-step controls (marker "slow").
# Extra arguments go to pytest (e.g. tests/test_core.py, -k criteria, -x; -n 0: one process).
# The tests run on every core (pytest-xdist), a test file per worker: most of them wait on
# single-threaded fairseq runs, and a file's tests share its module fixtures.
# PYTHON: another interpreter (e.g. PYTHON=python3.12), set up in an environment of its own,
# .venv-X.Y (.venv-3.12) unless VENV names one (scripts/setup.sh takes both).
# TEST_PYTHON: run with that interpreter's environment instead (no set-up: a machine
# without network, scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ] && [ -z "${VENV:-}" ]; then
  VENV=.venv-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  export VENV
fi
[ -n "${TEST_PYTHON:-}" ] || bash scripts/setup.sh
PYTHON=${TEST_PYTHON:-${VENV:-.venv}/bin/python}
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not slow" tests/test_core.py tests/test_criteria.py tests/test_fused_linear.py \
    tests/test_triton_kernel.py tests/test_loss_edges.py tests/test_plain_pytorch.py \
    tests/test_attendout.py tests/test_attendout_gate.py "$@"
fi
# testpaths (pytest.ini): tests/ and experiments/tests/
exec "$PYTHON" -m pytest -n "${TEST_WORKERS:-auto}" --dist loadfile "$@"
