"""What the recipe modules share: where the plugin and the repository are, fairseq's
command-line tools, a command line made from a docstring (:func:`parser_from_doc`, also for
benchmarks/ and experiments/), one-line errors, and no half-made output on failure."""

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]  # rdrop_fairseq/: the --user-dir
REPO = PLUGIN.parent  # the source checkout: configs/, data/


def fairseq_cli(name):
    """The path of fairseq's ``name`` CLI, by the rule scripts/lib/common.sh follows too: in
    $FAIRSEQ_BIN if set, else beside this Python (the environment the recipe runs in, even
    when not activated), else on PATH. Not found: the bare name in a dry run, else an
    error that says what to do."""
    if os.environ.get("FAIRSEQ_BIN"):
        return str(Path(os.environ["FAIRSEQ_BIN"]) / name)
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK) and beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found or dry_run():
        return found or name
    raise SystemExit(f"error: {name} is neither beside {sys.executable} nor on PATH: install "
                     "fairseq in this Python's environment, or set FAIRSEQ_BIN")


def write_json(path, obj):
    """Write ``obj`` to ``path`` atomically: an interruption leaves the old file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def dry_run():
    """Whether DRY_RUN=1 (scripts/*.sh): print the fairseq commands, run none."""
    return os.environ.get("DRY_RUN") == "1"


def show(cmd):
    """Print ``cmd`` as a shell line, ``++ `` first: a command that a recipe module run by a
    recipe script's ``+ `` line runs (as bash's ``set -x`` marks the nesting)."""
    print("++ " + shlex.join(map(str, cmd)), flush=True)


def one_pass_trainer(**kwargs):
    """A plain ``transformers.Trainer`` made with ``kwargs``: one pass, the model's own loss
    (the Hugging Face recipes' baseline), divided by ``gradient_accumulation_steps``. The
    Trainer counts a model whose forward takes ``**kwargs`` (BERT's and ViT's heads) as
    normalising its loss over the whole accumulated batch itself, and those heads take the
    mean of each batch: without this, k accumulation steps would give k times the
    gradient."""
    from transformers import Trainer

    from ..hf import declare_loss_scaling

    trainer = Trainer(**kwargs)
    declare_loss_scaling(trainer, False)
    return trainer


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help: the options)\n")


def add_rdrop_every(parser):
    """The Hugging Face recipes' ``--rdrop-every K`` and ``--rdrop-pass-mean``
    (RDropTrainer's ``rdrop_every`` and ``rdrop_pass_mean``)."""
    parser.add_argument("--rdrop-every", type=int, default=1, metavar="K",
                        help="train, MODE rdrop or no-kl: R-Drop on one optimizer update in K, "
                             "the others one pass with the model's own loss (default 1: every "
                             "update)")
    parser.add_argument("--rdrop-pass-mean", action="store_true",
                        help="train, MODE rdrop or no-kl: an R-Drop update's loss the mean of "
                             "its two passes' (a one-pass update's scale) instead of their sum")


def check_rdrop_every(parser, a):
    """``--rdrop-every``: a whole number >= 1, and R-Drop's (MODE rdrop or no-kl), as is
    ``--rdrop-pass-mean``."""
    if a.rdrop_every < 1:
        parser.error(f"--rdrop-every must be a whole number >= 1, got {a.rdrop_every}")
    if a.rdrop_every != 1 and a.mode not in ("rdrop", "no-kl"):
        parser.error(f"--rdrop-every {a.rdrop_every} is R-Drop's: --mode {a.mode} runs none")
    if a.rdrop_pass_mean and a.mode not in ("rdrop", "no-kl"):
        parser.error(f"--rdrop-pass-mean scales R-Drop's updates: --mode {a.mode} runs none")


def parser_from_doc(doc, **kwargs):
    """The command line of a script whose docstring ``doc`` is its help: the first paragraph
    the description, the rest the epilog, line breaks kept; errors on one line
    (:class:`ArgumentParser`). ``kwargs`` go to the parser (``prog``...)."""
    summary, _, details = doc.partition("\n\n")
    return ArgumentParser(description=summary, epilog=details or None,
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def run_stage(a, parser, prepare, train, evaluate, data_error):
    """The stage ``a.stage`` of a Hugging Face recipe module (glue_bert, vit): ``prepare(a)``,
    ``train(a, parser)`` or ``evaluate(a)``; an error in the data (``data_error``) ends the
    run in one line."""
    try:
        if a.stage == "prepare":
            return prepare(a)
        if a.stage == "train":
            return train(a, parser)
        return evaluate(a)
    except data_error as e:
        sys.exit(f"error: {e}")


def need(parser, flag, path, advice):
    """Stop, in one line (``parser.error``), unless the file ``path`` (``flag``'s) exists,
    saying what makes it as the recipe scripts do (``run: bash scripts/iwslt14.sh prepare``,
    ``train first: ...``)."""
    if not Path(path).is_file():
        parser.error(f"{flag}: {path} not found: {advice}")


@contextlib.contextmanager
def made_or_removed(out, *if_empty):
    """Run the block that fills the folder ``out``; if it fails, remove ``out`` when this run
    made it (and the folders ``if_empty`` when this run made them and they are still empty,
    e.g. a download folder), so that a failure leaves nothing half-made behind. A failed
    subprocess becomes a one-line error."""
    made = [Path(d) for d in (out, *if_empty) if not Path(d).exists()]
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        for folder in made:
            if folder == Path(out) or not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, subprocess.CalledProcessError):
            command = " ".join(map(str, e.cmd[:3]))
            raise SystemExit(f"error: {command} ... failed (exit code {e.returncode}; its "
                             "messages are above)") from None
        raise
