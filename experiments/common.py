"""What the experiments share: the command line of a recipe script (scripts/*.sh), and
options followed by hydra overrides."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def recipe_script(name, stage, *args, **variables):
    """``env VAR=value ... bash scripts/NAME.sh STAGE ARGS``: a recipe script on the CPU
    (GPUS=0), with this Python and the fairseq CLIs in $FAIRSEQ_BIN if set, else those
    installed beside it."""
    env = {"GPUS": 0, "PYTHON": sys.executable,
           "FAIRSEQ_BIN": os.environ.get("FAIRSEQ_BIN") or Path(sys.executable).parent,
           **variables}
    return ["env", *(f"{k}={v}" for k, v in env.items()),
            "bash", str(REPO / "scripts" / f"{name}.sh"), stage, *map(str, args)]


def parse_with_overrides(parser, argv):
    """``parser.parse_args`` of what comes before ``--``; what follows is kept, as
    fairseq-hydra-train overrides, in ``.overrides``."""
    overrides = []
    if "--" in argv:
        argv, overrides = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a = parser.parse_args(argv)
    a.overrides = overrides
    return a
