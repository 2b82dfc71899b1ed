#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine without network (WHEELS=.whl): what
# fairseq, the recipes and the tests need beyond what such a machine already holds (torch
# for CUDA, triton, pytest, pytest-xdist, scikit-learn, scipy, sacrebleu, sentencepiece,
# matplotlib..., Python 3.12). Run it where pip can download; about 45 MB. DEST (default
# .whl, ignored by git) and PY_VERSION (the GPU machine's Python, default 3.12) change
# where and for what.
#
#   bash scripts/lib/gpu_wheels.sh           # here, then carry .whl to the GPU machine
#   WHEELS=.whl bash scripts/gpu_check.sh    # there
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p "$DEST"
# the versions scripts/setup.sh's environment runs the suite with; numpy < 2 for fairseq 0.12
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  ve-fairseq==0.12.3 numpy==1.26.4 bitarray==3.12.3 hydra-core==1.3.8 omegaconf==2.3.1 \
  sacremoses==0.2.0 subword-nmt==0.3.8 mock==5.2.0 nltk==3.10.4 tensorboardX==2.6.5 six==1.17.0
# pure-Python packages published as source only: built into wheels here
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" \
  antlr4-python3-runtime==4.9.3 rouge-score==0.1.2
ls "$DEST"
du -sh "$DEST"
