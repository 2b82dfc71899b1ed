#!/usr/bin/env bash
# scripts/gpu_check.sh's set-up on a machine without network (WHEELS=DIR): a venv VENV that
# sees BASE_PYTHON's packages (torch for CUDA, triton, pytest...), with the wheels of DIR
# (scripts/lib/gpu_wheels.sh: fairseq and what it, the recipes and the tests need besides)
# and this checkout (a .pth file: an editable install that needs no build).
#   bash scripts/lib/gpu_venv.sh VENV DIR BASE_PYTHON
# The base's site-packages come after the venv's (its own .pth files included), so a wheel
# here wins over the base's copy: numpy < 2 (fairseq 0.12 uses np.compat), unless the
# base's scipy or scikit-learn refuse it; then the base's numpy stays, and this says so.
# (Not venv --system-site-packages: the base is often a venv itself, whose packages that
# would not see.)
set -euo pipefail
venv=$1 wheels=$2 base=$3
repo=$(cd "$(dirname "$0")/../.." && pwd)
compgen -G "$wheels/*.whl" >/dev/null || { echo "no wheels in $wheels (scripts/lib/gpu_wheels.sh)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
py=$venv/bin/python
# the wheels first, while pip sees none of the base's packages (nothing of it to replace)
"$py" -m pip install -q --disable-pip-version-check --no-index --no-deps "$wheels"/*.whl
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$base" -c "import site
print('import site; ' + '; '.join(f'site.addsitedir({d!r})' for d in site.getsitepackages()))
" >"$site/zz_base_site_packages.pth"
echo "$repo" >"$site/rdrop_fairseq_checkout.pth"
check="import numpy, scipy, sklearn, torch, fairseq, rdrop_fairseq"
if ! (cd / && "$py" -c "$check") 2>"$venv/numpy-check.err"; then
  echo "[gpu_venv] with numpy < 2: $(tail -n 1 "$venv/numpy-check.err"); keeping the machine's numpy"
  "$py" -m pip uninstall -q -y numpy
fi
cd / && "$py" -c "$check
print('[gpu_venv] ok:', 'torch', torch.__version__, 'numpy', numpy.__version__, 'fairseq',
      fairseq.__version__, 'rdrop_fairseq from', rdrop_fairseq.__file__)"
