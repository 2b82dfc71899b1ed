"""The package's shape, read from its syntax trees: no private name crosses a module, no
function over 60 lines and no class over 250 (a definition's lines, its docstring not
counted; Triton kernels and argument-parser builders aside), no module over 450 lines
outside recipes/, the Hugging Face layer a package that gives its public names, the two row
implementations on one fp16 scale and behind one door (only ops/ names them), and no
import running back up from options.py or ops/."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rdrop_fairseq"
MODULES = sorted(PACKAGE.rglob("*.py"))
LONGEST_FUNCTION, LONGEST_CLASS = 60, 250
LONGEST_MODULE = 450  # lines, outside recipes/ (scripts, each with its command line)
ROW_IMPLEMENTATIONS = {"rows_torch", "rows_triton", "rdrop_rows_triton"}


def tree(path):
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def counted_lines(node):
    """A definition's lines from its ``def``/``class`` line to its end, less its docstring."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def is_exempt(node):
    """A ``@triton.jit`` kernel, or a function that mostly adds command-line arguments."""
    if any("triton" in ast.unparse(d) for d in node.decorator_list):
        return True
    calls = [s for s in node.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
             and getattr(s.value.func, "attr", "") == "add_argument"]
    return len(calls) * 2 >= len(node.body)


def test_the_counting_sees_a_long_function_and_a_docstring():
    """The rule's own check: a 61-line body is too long, its docstring does not count."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    long = ast.parse(f"def f():\n{body}\n").body[0]
    documented = ast.parse(f'def f():\n    """a\n    b\n    """\n{body[:-len("    x59 = 59")]}'
                           ).body[0]
    assert counted_lines(long) == 61 and counted_lines(documented) == 60


def test_no_function_over_60_lines_and_no_class_over_250():
    too_long = []
    for path in MODULES:
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if counted_lines(node) > LONGEST_FUNCTION and not is_exempt(node):
                    too_long.append((str(path.relative_to(REPO)), node.name, counted_lines(node)))
            elif isinstance(node, ast.ClassDef) and counted_lines(node) > LONGEST_CLASS:
                too_long.append((str(path.relative_to(REPO)), node.name, counted_lines(node)))
    assert too_long == []
    assert len(MODULES) > 50  # the whole package was read


def test_no_module_imports_a_private_name_from_another():
    """A name another module needs is public (or the boundary is in the wrong place)."""
    found = []
    for path in MODULES:
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and (
                    node.level > 0 or (node.module or "").startswith("rdrop_fairseq")):
                found += [(str(path.relative_to(REPO)), node.lineno, alias.name)
                          for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and isinstance(node.value, ast.Name) and \
                    node.value.id in {p.stem for p in MODULES}:
                found.append((str(path.relative_to(REPO)), node.lineno, ast.unparse(node)))
    assert found == []


def test_the_hugging_face_layer_is_a_package_that_gives_its_public_names():
    pytest.importorskip("transformers")
    from rdrop_fairseq import hf

    assert Path(hf.__file__).name == "__init__.py"
    rooms = {p.stem for p in Path(hf.__file__).parent.glob("*.py")}
    assert {"trainers", "loss", "kind", "model"} <= rooms
    for name in ("RDropMixin", "RDropTrainer", "RDropSeq2SeqTrainer", "rdrop_hf_loss",
                 "model_kind", "labelled_items", "declare_loss_scaling", "warmup_arguments",
                 "TRANSFORMERS_RANGE"):
        assert name in hf.__all__ and getattr(hf, name) is not None, name
    from rdrop_fairseq.hf.trainers import RDropTrainer

    assert hf.RDropTrainer is RDropTrainer


def test_the_two_row_implementations_scale_fp16_alike():
    """The kernel's module imports nothing of the package (its tests load it alone), so it
    holds its own copy of the fp16 scale's target: the same as the contract's."""
    def constant(path, name):
        (value,) = [node.value for node in tree(path).body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == name for t in node.targets)]
        return eval(compile(ast.Expression(value), str(path), "eval"))

    ops = PACKAGE / "ops"
    assert constant(ops / "rows_triton.py", "FP16_TARGET_MAX") == \
        constant(ops / "rows.py", "FP16_TARGET_MAX") == 2.0 ** 14
    kernel = tree(ops / "rows_triton.py")
    assert not [n for n in ast.walk(kernel) if isinstance(n, ast.ImportFrom) and
                (n.level or (n.module or "").startswith("rdrop_fairseq"))]


def imported_modules(path):
    """The dotted names of the package's modules that ``path`` imports (anywhere in it,
    function-level imports included), relative imports resolved; with the names imported
    from each (``from .x import a`` gives ``x`` and ``x.a``: ``a`` may be a module)."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [m for m in found if m == "rdrop_fairseq" or m.startswith("rdrop_fairseq.")]


def test_the_import_resolution_reads_relative_and_function_level_imports():
    """The rules below rely on it: a relative import two levels up, inside a function."""
    ops_impl = PACKAGE / "ops" / "impl.py"
    assert "rdrop_fairseq.options.IMPLS" in imported_modules(ops_impl)
    assert "rdrop_fairseq.ops.rows_triton.rdrop_rows_triton" in imported_modules(ops_impl)


def test_the_row_op_has_one_door():
    """Only ops/ names an implementation of the row op (:func:`ops.impl.run_rows` is the
    call of either): no module elsewhere imports rows_torch / rows_triton, nor names
    rows_torch or rdrop_rows_triton."""
    found = []
    for path in MODULES:
        if path.parent == PACKAGE / "ops":
            continue
        for module in imported_modules(path):
            if set(module.split(".")) & ROW_IMPLEMENTATIONS:
                found.append((str(path.relative_to(REPO)), module))
        for node in ast.walk(tree(path)):
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if name in ROW_IMPLEMENTATIONS:
                found.append((str(path.relative_to(REPO)), node.lineno, name))
    assert found == []


def test_no_import_runs_back_up_from_options_or_ops():
    """options.py is the floor: it imports nothing of the package. ops/ stands on it
    alone: its modules import only each other and options.py."""
    options = PACKAGE / "options.py"
    assert imported_modules(options) == []
    upward = [(str(path.relative_to(REPO)), module)
              for path in sorted((PACKAGE / "ops").glob("*.py"))
              for module in imported_modules(path)
              if not module.startswith(("rdrop_fairseq.ops", "rdrop_fairseq.options"))]
    assert upward == []


def test_no_module_over_450_lines_outside_recipes():
    long = [(str(path.relative_to(REPO)), lines) for path in MODULES
            if PACKAGE / "recipes" not in path.parents
            and (lines := len(path.read_text(encoding="utf-8").splitlines())) > LONGEST_MODULE]
    assert long == []
