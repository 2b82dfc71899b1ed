"""scripts/setup.sh's stamp: a passed check is remembered, and checked again when what it
depends on changes. On a stand-in environment whose python only counts its calls and
passes (the check itself runs at the start of every test run, scripts/test.sh)."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_passed_check_is_remembered_until_the_environment_changes(tmp_path):
    venv, calls = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncat > /dev/null\n'
                      'echo "[setup] ok: stand-in"\n')
    python.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "VENV": str(venv)}

    def setup(**extra):
        proc = subprocess.run(["bash", REPO / "scripts" / "setup.sh"], capture_output=True,
                              text=True, timeout=60, env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "[setup] ok: stand-in\n"
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    assert setup() == 1  # checked, stamp written
    assert setup() == 1  # the stamp stands for the check
    (site / "other-1.0.dist-info").mkdir()  # a distribution installed
    assert setup() == 2
    assert setup() == 2
    (site / "__editable__.rdrop.pth").write_text("/elsewhere\n")  # an editable install
    assert setup() == 3
    assert setup(PYTHONPATH=str(tmp_path)) == 4  # another rdrop_fairseq may be imported
    assert setup(SETUP_CHECK="1", PYTHONPATH=str(tmp_path)) == 5  # asked to check
    assert setup(PYTHONPATH=str(tmp_path)) == 5
