"""What importing the plugin does (issue 26): the torch-only core loads without fairseq, and
fairseq's ``--user-dir`` registers every criterion, model and task of the plugin, also when
``rdrop_fairseq`` was imported before fairseq (``import_user_module`` then imports nothing).

Each case runs in a fresh interpreter, since what is in ``sys.modules`` is the point. The
expected names are read from the plugin's source (its ``register_*`` decorators), not from
the package.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "rdrop_fairseq"

REGISTRIES = {  # fairseq registry -> the decorator that fills it
    "fairseq.criterions.CRITERION_REGISTRY": r"register_criterion\(\s*\"(\w+)\"",
    "fairseq.models.MODEL_REGISTRY": r"register_model\(\s*\"(\w+)\"",
    "fairseq.models.ARCH_MODEL_REGISTRY": r"register_model_architecture\(\s*\"\w+\",\s*\"(\w+)\"",
    "fairseq.tasks.TASK_REGISTRY": r"register_task\(\s*\"(\w+)\"",
}


def plugin_names():
    """{registry: names the plugin's source registers there}."""
    sources = "\n".join(p.read_text() for sub in ("criterions", "models", "tasks")
                        for p in (PLUGIN / sub).glob("*.py"))
    return {registry: sorted(set(re.findall(pattern, sources)))
            for registry, pattern in REGISTRIES.items()}


def python(script):
    """Runs ``script`` in a fresh interpreter with this checkout first on the path; returns
    the JSON its last line prints."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPORT = """
import importlib, json, sys
found = {}
for registry in %r:
    module, name = registry.rsplit(".", 1)
    found[registry] = sorted(getattr(importlib.import_module(module), name))
print(json.dumps(found))
""" % (list(REGISTRIES),)


def test_the_plugin_registers_something():
    names = plugin_names()
    assert "cross_entropy_rdrop" in names["fairseq.criterions.CRITERION_REGISTRY"]
    assert all(len(v) >= 1 for v in names.values()), names
    assert len(names["fairseq.criterions.CRITERION_REGISTRY"]) == 4


@pytest.mark.parametrize("before", [
    "",  # fairseq-train --user-dir: fairseq first
    "import rdrop_fairseq",  # the trap: already in sys.modules when --user-dir comes
    "import rdrop_fairseq.core",  # a plain-torch script that then runs fairseq in-process
    "import rdrop_fairseq.criterions",  # an explicit import, which imports fairseq itself
], ids=["fairseq-first", "package-first", "core-first", "criterions-first"])
def test_user_dir_registers_every_criterion_model_and_task(before):
    found = python(textwrap.dedent(f"""
        import argparse
        {before}
        from fairseq.utils import import_user_module
        import_user_module(argparse.Namespace(user_dir={str(PLUGIN)!r}))
    """) + REPORT)
    for registry, names in plugin_names().items():
        missing = set(names) - set(found[registry])
        assert not missing, f"{registry} lacks {sorted(missing)} (imported first: {before!r})"


def test_the_core_does_not_import_fairseq():
    """``rdrop_fairseq.core`` and ``fused_linear`` need torch alone: fairseq stays unloaded
    though it is installed; the checkpoint allow-list is still set on a plain import."""
    assert importlib.util.find_spec("fairseq") is not None, "the check needs fairseq installed"
    out = python("""
        import argparse, json, sys, torch
        import rdrop_fairseq
        from rdrop_fairseq.core import rdrop_loss
        from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
        logits = torch.randn(4, 7, requires_grad=True)
        rdrop_loss(logits, torch.tensor([1, 2]), alpha=1.0).total.backward()
        print(json.dumps({
            "fairseq": sorted(m for m in sys.modules if m.split(".")[0] == "fairseq"),
            "criteria": "rdrop_fairseq.criterions" in sys.modules,
            "allow_listed": argparse.Namespace in torch.serialization.get_safe_globals(),
        }))
    """)
    assert out == {"fairseq": [], "criteria": False, "allow_listed": True}


def test_importing_fairseq_later_registers_the_plugin():
    """``import rdrop_fairseq`` then ``import fairseq`` (no --user-dir): registered, and
    fairseq's module keeps its own loader (nothing of ours stays on the import path)."""
    found = python("""
        import json, sys
        import rdrop_fairseq
        hooks = [type(f).__name__ for f in sys.meta_path]
        import fairseq
        after = [type(f).__name__ for f in sys.meta_path]
        print(json.dumps({"hooked": "_RegisterAfterFairseq" in hooks,
                          "left": "_RegisterAfterFairseq" in after,
                          "loader": type(fairseq.__loader__).__name__,
                          "spec_loader": type(fairseq.__spec__.loader).__name__}))
    """)
    assert found == {"hooked": True, "left": False, "loader": "SourceFileLoader",
                     "spec_loader": "SourceFileLoader"}
    found = python("import rdrop_fairseq, fairseq\n" + REPORT)
    for registry, names in plugin_names().items():
        assert set(names) <= set(found[registry]), registry
