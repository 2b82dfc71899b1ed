"""What importing the plugin does (issue 26): the torch-only core loads without fairseq, and
fairseq's ``--user-dir`` registers every criterion, model and task of the plugin, also when
``rdrop_fairseq`` was imported before fairseq (``import_user_module`` then imports nothing).

Each case runs in a fresh interpreter, since what is in ``sys.modules`` is the point: one per
order of imports (``probe``: what comes first, then ``import fairseq``, then ``--user-dir``),
whose report the tests share. The expected names are read from the plugin's source (its
``register_*`` decorators), not from the package. Also: torch's checkpoint allow-list is set
whether torch is imported before the plugin or after it, and a recipe module that only runs
fairseq's tools imports neither torch nor fairseq.
"""

import functools
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


BEFORE = {
    "fairseq-first": "",  # fairseq-train --user-dir: fairseq first
    "package-first": "import rdrop_fairseq",  # the trap: in sys.modules when --user-dir comes
    "core-first": "import rdrop_fairseq.core",  # a plain-torch script, then fairseq in-process
    "criterions-first": "import rdrop_fairseq.criterions",  # imports fairseq itself
}


ALLOWED = "argparse.Namespace in torch.serialization.get_safe_globals()"


@functools.lru_cache(maxsize=None)
def probe(case):
    """One fresh interpreter per case of BEFORE: what it imports first, then ``import
    fairseq`` (its registries then: ``imported``), then ``--user-dir`` (``found``)."""
    before = textwrap.dedent(f"""
        import argparse, json, sys
        {BEFORE[case]}
        hooks = [type(f).__name__ for f in sys.meta_path]
        torch_first = "torch" in sys.modules
        import fairseq, torch
        state = {{"hooks": hooks, "left": [type(f).__name__ for f in sys.meta_path],
                  "torch_first": torch_first, "allow_listed_then": {ALLOWED},
                  "loader": type(fairseq.__loader__).__name__,
                  "spec_loader": type(fairseq.__spec__.loader).__name__}}
    """)
    user_dir = textwrap.dedent(f"""
        from fairseq.utils import import_user_module
        import_user_module(argparse.Namespace(user_dir={str(PLUGIN)!r}))
        state["allow_listed"] = {ALLOWED}
    """)
    imported = REPORT.replace("print(json.dumps(found))", "state['imported'] = found")
    found = REPORT.replace("print(json.dumps(found))", "print(json.dumps({**state, **found}))")
    return python(before + imported + user_dir + found)


@pytest.mark.parametrize("case", list(BEFORE))
def test_user_dir_registers_every_criterion_model_and_task(case):
    found = probe(case)
    for registry, names in plugin_names().items():
        missing = set(names) - set(found[registry])
        assert not missing, f"{registry} lacks {sorted(missing)} (imported first: {case})"
    assert found["allow_listed"]  # torch loaded before the plugin or after it


def test_the_core_does_not_import_fairseq():
    """``rdrop_fairseq.core`` and ``fused_linear`` need torch alone: fairseq and transformers
    stay unloaded though they are installed; the checkpoint allow-list is still set on a
    plain import. A recipe module that only runs fairseq's tools imports neither torch nor
    fairseq, and ``rdrop_fairseq.hf`` (RDropTrainer) no fairseq."""
    assert importlib.util.find_spec("fairseq") is not None, "the check needs fairseq installed"
    out = python("""
        import argparse, json, sys
        import rdrop_fairseq.recipes.evaluate_lm
        recipe = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fairseq"))
        import torch
        from rdrop_fairseq.core import rdrop_loss
        from rdrop_fairseq.fused_linear import fused_linear_rdrop_loss
        logits = torch.randn(4, 7, requires_grad=True)
        rdrop_loss(logits, torch.tensor([1, 2]), alpha=1.0).total.backward()
        transformers = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
        from rdrop_fairseq.hf import RDropTrainer  # Hugging Face's side: no fairseq either
        print(json.dumps({
            "recipe": recipe,
            "fairseq": sorted(m for m in sys.modules if m.split(".")[0] == "fairseq"),
            "criteria": "rdrop_fairseq.criterions" in sys.modules,
            "allow_listed": argparse.Namespace in torch.serialization.get_safe_globals(),
            "transformers": transformers,
        }))
    """)
    assert out == {"recipe": [], "fairseq": [], "criteria": False, "allow_listed": True,
                   "transformers": []}


def test_importing_fairseq_later_registers_the_plugin():
    """``import rdrop_fairseq`` then ``import fairseq`` (no --user-dir): registered, and
    fairseq's module keeps its own loader (nothing of ours stays on the import path). The
    package alone imports no torch; importing torch later sets the checkpoint allow-list."""
    found = probe("package-first")
    keys = ("torch_first", "allow_listed_then", "loader", "spec_loader")
    assert {k: found[k] for k in keys} == {"torch_first": False, "allow_listed_then": True,
                                           "loader": "SourceFileLoader",
                                           "spec_loader": "SourceFileLoader"}
    assert {"_RegisterAfterFairseq", "_AllowListAfterTorch"} <= set(found["hooks"])
    assert not {"_RegisterAfterFairseq", "_AllowListAfterTorch"} & set(found["left"])
    for registry, names in plugin_names().items():
        assert set(names) <= set(found["imported"][registry]), registry


LOOKUPS = {  # what runs after the plugin (or before it), then the registries are read
    # a library testing whether packages are installed: a lookup that executes nothing
    "find_spec-then-import": """
        import rdrop_fairseq
        for name in ("fairseq", "torch", "fairseq", "torch"):
            assert importlib.util.find_spec(name) is not None
        hooks_after_lookups = [type(f).__name__ for f in sys.meta_path]
        import fairseq
    """,
    "find_spec-then-import_module": """
        import rdrop_fairseq
        importlib.util.find_spec("torch"); importlib.util.find_spec("fairseq")
        hooks_after_lookups = [type(f).__name__ for f in sys.meta_path]
        importlib.import_module("fairseq")
    """,
    "fairseq-first-then-find_spec": """
        import fairseq
        importlib.util.find_spec("fairseq"); importlib.util.find_spec("torch")
        import rdrop_fairseq
        hooks_after_lookups = [type(f).__name__ for f in sys.meta_path]
        importlib.util.find_spec("fairseq")
    """,
}


@pytest.mark.parametrize("case", list(LOOKUPS))
def test_a_lookup_does_not_spend_the_import_hooks(case):
    """``importlib.util.find_spec`` executes nothing, so it must leave the hooks in place:
    fairseq imported later (by ``import`` or ``import_module``) still gets the criteria, and
    torch the checkpoint allow-list. Once the modules have run, no hook is left."""
    out = python(textwrap.dedent("""
        import argparse, importlib, importlib.util, json, sys
    """) + textwrap.dedent(LOOKUPS[case]) + textwrap.dedent(f"""
        import torch
        from fairseq.criterions import CRITERION_REGISTRY
        print(json.dumps({{
            "hooks_after_lookups": hooks_after_lookups,
            "left": [type(f).__name__ for f in sys.meta_path],
            "allow_listed": {ALLOWED},
            "criteria": sorted(CRITERION_REGISTRY),
        }}))
    """))
    missing = set(plugin_names()["fairseq.criterions.CRITERION_REGISTRY"]) - set(out["criteria"])
    assert not missing, f"criteria missing after {case}: {sorted(missing)}"
    assert out["allow_listed"], case
    ours = {"_RegisterAfterFairseq", "_AllowListAfterTorch"}
    if case.startswith("fairseq-first"):  # both loaded when the plugin came: no hook needed
        assert not ours & set(out["hooks_after_lookups"])
    else:
        assert ours <= set(out["hooks_after_lookups"]), out["hooks_after_lookups"]
    assert not ours & set(out["left"]), out["left"]
