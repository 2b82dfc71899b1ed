"""What the recipe modules share: where the plugin and the repository are, fairseq's
command-line tools, one-line errors, and no half-made output on failure."""

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]  # rdrop_fairseq/: the --user-dir
REPO = PLUGIN.parent  # the source checkout: configs/, data/


def fairseq_cli(name):
    """The path of fairseq's ``name`` CLI: in $FAIRSEQ_BIN if set (as scripts/*.sh), else on
    PATH, else next to this Python (a virtual environment that is not activated)."""
    if os.environ.get("FAIRSEQ_BIN"):
        return str(Path(os.environ["FAIRSEQ_BIN"]) / name)
    return shutil.which(name) or str(Path(sys.executable).parent / name)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help: the options)\n")


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
