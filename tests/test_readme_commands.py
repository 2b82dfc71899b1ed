"""The README's commands work as printed, on tiny data: the hydra example (absolute paths,
hydra's config and log in the save dir, no outputs/ left behind) and the one line that runs
fairseq-generate without --user-dir. Each runs through bash in a directory laid out like
the repository root; only size overrides are appended."""

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.warm_process import fairseq_bin, machine_env

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TINY = ["common.cpu=true", "optimization.max_update=4", "dataset.max_tokens=1000",
        "task.eval_bleu_detok=space", "dataset.num_workers=0", "common.no_progress_bar=true",
        "model.encoder_layers=1", "model.decoder_layers=1", "model.encoder_embed_dim=32",
        "model.decoder_embed_dim=32", "model.encoder_ffn_embed_dim=64",
        "model.decoder_ffn_embed_dim=64"]
WORDS = ["haus", "baum", "katze", "hund", "auto", "buch", "tisch", "stuhl", "garten", "wasser"]


def bash(command, cwd):
    # fairseq's tools, called by name, start warm (tests/warm_process.py); the README's
    # `python -c` runs the real interpreter (the python stand-in execs it)
    env = {**machine_env(),
           "PATH": os.pathsep.join([fairseq_bin(), str(Path(sys.executable).parent),
                                    "/usr/bin", "/bin"]),
           "HOME": str(cwd), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "USER_DIR": str(REPO / "rdrop_fairseq")}  # what `python -m rdrop_fairseq` prints
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, command + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def printed(pattern):
    """The README's command matching ``pattern``, continuation lines joined."""
    m = re.search(pattern, README, re.S)
    assert m, f"no {pattern} in README.md"
    return m[1].replace("\\\n", " ")


def test_readme_hydra_example_and_generate_line(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(0)
    for split, n in {"train": 200, "valid": 20, "test": 20}.items():
        pairs = [[rng.choice(WORDS) for _ in range(rng.randint(3, 8))] for _ in range(n)]
        (raw / f"{split}.de").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (raw / f"{split}.en").write_text("".join(" ".join(p[::-1]).upper() + "\n" for p in pairs))
    bash("fairseq-preprocess --source-lang de --target-lang en --joined-dictionary "
         "--trainpref raw/train --validpref raw/valid --testpref raw/test "
         "--destdir data-bin/iwslt14.de-en --workers 1", tmp_path)

    hydra = printed(r"```bash\n(fairseq-hydra-train .*?)\n```")
    assert "$PWD/data-bin/iwslt14.de-en" in hydra and "hydra.run.dir=" in hydra
    out = bash(f"{hydra} {' '.join(TINY)}", tmp_path)
    save = tmp_path / "checkpoints" / "rdrop"
    assert (save / "checkpoint_best.pt").is_file(), out[-3000:]
    assert (save / ".hydra" / "config.yaml").is_file()  # hydra's run dir is the save dir
    assert not (tmp_path / "outputs").exists()

    # the README generates from checkpoints/checkpoint_best.pt
    shutil.copy(save / "checkpoint_best.pt", tmp_path / "checkpoints")
    generate = printed(r"`(python -c \"import rdrop_fairseq.*?)`")
    out = bash(f"{generate} --cpu --max-len-b 10", tmp_path)
    assert "Generate test with beam=5: BLEU4 = " in out, out[-3000:]
    # every test sentence translated (without --required-batch-size-multiple 1, fairseq's
    # default multiple of 8 loses the last sentences of a test set: 56 of 60 were seen)
    hypotheses = sorted(int(i) for i in re.findall(r"^H-(\d+)\t", out, re.M))
    assert hypotheses == list(range(20)), out[-3000:]

    # the fairseq-generate example of "Use it", with --user-dir
    user_dir_generate = printed(r"\n(fairseq-generate data-bin/iwslt14.de-en --user-dir .*?)\n```")
    out = bash(f"{user_dir_generate} --cpu --max-len-b 10", tmp_path)
    assert sorted(int(i) for i in re.findall(r"^H-(\d+)\t", out, re.M)) == list(range(20))
