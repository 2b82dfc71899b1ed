"""What the recipe modules share: where the plugin, the configs and fairseq's CLIs are;
overrides after ``--``, the checks of the common options, the fairseq-hydra-train
command's base and optional parts, the launch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]  # rdrop_fairseq/: the --user-dir
REPO = PLUGIN.parent  # the source checkout: configs/, data/


def fairseq_cli(name):
    """The path of fairseq's ``name`` CLI: in $FAIRSEQ_BIN if set, else on PATH, else next
    to this Python (a virtual environment that is not activated)."""
    if os.environ.get("FAIRSEQ_BIN"):
        return str(Path(os.environ["FAIRSEQ_BIN"]) / name)
    return shutil.which(name) or str(Path(sys.executable).parent / name)


HYDRA_TRAIN = fairseq_cli("fairseq-hydra-train")


def parse_with_overrides(parser, argv):
    """``parser.parse_args`` of what comes before ``--``; what follows is kept, as
    fairseq-hydra-train overrides, in ``.overrides``."""
    overrides = []
    if "--" in argv:
        argv, overrides = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a = parser.parse_args(argv)
    a.overrides = overrides
    return a


def check_common(parser, a, modes):
    """A ``--mode`` taken from $MODE (argparse does not check defaults), and the required
    --data / --save-dir."""
    if a.mode not in modes:
        parser.error(f"--mode (or $MODE) must be one of {', '.join(modes)}, not {a.mode!r}")
    for name in ("data", "save_dir"):
        if not getattr(a, name):
            parser.error(f"--{name.replace('_', '-')} (or ${name.upper()}) is required")


def base_command(config, a, launcher=(HYDRA_TRAIN,)):
    """fairseq-hydra-train (or ``launcher``) with a config of configs/, the plugin, the data,
    the save dir (hydra's own output inside it) and the seed."""
    save_dir = Path(a.save_dir).resolve()
    return [*launcher, "--config-dir", str(REPO / "configs"), "--config-name", config,
            f"common.user_dir={PLUGIN}", f"task.data={Path(a.data).resolve()}",
            f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={save_dir / 'hydra'}",
            f"common.seed={a.seed}"]


def baseline_alpha(mode, alpha, without_kl=("baseline",)):
    """Alpha 0 for a mode without the KL, refusing a contradicting --alpha; else ``alpha``."""
    if mode not in without_kl:
        return alpha
    if alpha not in (None, 0):
        sys.exit(f"error: --alpha {alpha} contradicts --mode {mode} (which has no KL)")
    return 0.0


def optional_overrides(max_tokens=None, max_update=None, update_freq=None, cpu=False):
    out = []
    if max_tokens:
        out.append(f"dataset.max_tokens={max_tokens}")
    if max_update:
        out.append(f"optimization.max_update={max_update}")
    if update_freq:
        out.append(f"optimization.update_freq=[{update_freq}]")
    if cpu:
        out.append("common.cpu=true")
    return out


def launch(cmd, save_dir, env=None):
    print("[train] " + " ".join(cmd), flush=True)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    sys.exit(subprocess.call(cmd, env=env))
