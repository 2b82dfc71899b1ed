"""``python -m rdrop_fairseq``: the plugin's directory (for ``--user-dir``), ``--help``, and
``--options``: every option the plugin adds to fairseq with its default and help, which
``fairseq-train --help`` cannot show (it prints its help before the criterion, model and
task add their options). The printed defaults are checked against what fairseq itself
resolves when it parses a training command line."""

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPTION_LINE = re.compile(r"^  (--[a-z0-9-]+)(?: \S+)?\s+default: (.*)$")


def main(*args):
    return subprocess.run([sys.executable, "-m", "rdrop_fairseq", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def printed():
    """``{component header: {option: printed default}}`` and the whole output."""
    proc = main("--options")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections, current = {}, None
    for line in proc.stdout.splitlines():
        m = OPTION_LINE.match(line)
        if m:
            sections[current][m[1]] = m[2]
        elif line and not line.startswith(" "):
            current = line
            sections[current] = {}
    return {k: v for k, v in sections.items() if v}, proc.stdout


def test_no_argument_prints_the_plugin_directory():
    proc = main()
    assert proc.returncode == 0 and proc.stdout == f"{REPO / 'rdrop_fairseq'}\n", proc.stdout


def test_help_prints_usage_not_the_directory():
    proc = main("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m rdrop_fairseq"), proc.stdout
    assert "--options" in proc.stdout and "--user-dir" in proc.stdout


def test_an_unknown_argument_is_refused():
    proc = main("--option")  # no abbreviations: a typo must not pass for --options
    assert proc.returncode == 2 and "unrecognized arguments: --option" in proc.stderr


def test_without_fairseq_the_directory_prints_and_options_is_one_line():
    """``python -S``: no site-packages, so neither fairseq nor torch (the plain-PyTorch
    install has no fairseq either)."""
    def no_site(*args):
        return subprocess.run([sys.executable, "-S", "-m", "rdrop_fairseq", *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    assert no_site().stdout == f"{REPO / 'rdrop_fairseq'}\n"
    proc = no_site("--options")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "fairseq does not import in this Python" in proc.stderr


def expected_defaults(criterion):
    """The plugin's options as fairseq-train resolves them for one criterion, with the
    AttendOut model and task: ``{option: value}``."""
    from fairseq import options

    import rdrop_fairseq

    rdrop_fairseq.register()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "DATA", "--user-dir", str(REPO / "rdrop_fairseq"), "--task",
        "sentence_prediction_attendout", "--arch", "roberta_attendout_base", "--criterion",
        criterion])
    return {"--" + k.replace("_", "-"): v for k, v in vars(args).items()
            if k.startswith(("rdrop_", "attendout_"))}


def same(printed_default, value):
    if isinstance(value, bool):
        return printed_default == ("on" if value else "off")
    if value in ("", None):
        return printed_default == "(none)"
    return printed_default == str(value)


def test_options_lists_every_option_with_the_default_fairseq_resolves(printed):
    from rdrop_fairseq.criterions.rdrop import RDropConfig

    sections, text = printed
    criteria = ("label_smoothed_cross_entropy_rdrop", "cross_entropy_rdrop",
                "adaptive_loss_rdrop", "sentence_prediction_rdrop")
    (criteria_header,) = [h for h in sections if h.startswith("criteria")]
    assert all(c in criteria_header for c in criteria), criteria_header
    listed = {option: default for options in sections.values()
              for option, default in options.items()}
    assert sum(len(options) for options in sections.values()) == len(listed)  # once each
    for criterion in criteria:
        resolved = expected_defaults(criterion)
        assert set(listed) == set(resolved), set(listed) ^ set(resolved)
        for option, value in resolved.items():
            assert same(listed[option], value), (option, listed[option], value)
    # every R-Drop field, under the criteria; AttendOut's under the model and the task
    assert set(sections[criteria_header]) == {
        "--" + f.name.replace("_", "-") for f in fields(RDropConfig) if f.name.startswith("rdrop_")}
    (model,) = [h for h in sections if h.startswith("model roberta_attendout")]
    (task,) = [h for h in sections if h.startswith("task sentence_prediction_attendout")]
    assert "--attendout-static-prune-layers" in sections[model]
    assert "--attendout-interval" in sections[task]
    assert sections[task]["--attendout-decision"] == "layer"
    assert "--rdrop-impl {auto,torch,triton}" in text and "--rdrop-alpha FLOAT" in text
    assert "weight of the R-Drop consistency term" in text  # the help, from the config
