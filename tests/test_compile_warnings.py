"""No module of the package, the benchmarks, the experiments or the tests prints a warning
when Python compiles it (an invalid escape such as "\\p" in a plain string: a
SyntaxWarning from Python 3.12 on, which a recipe prints before its one-line error).
Compiled with every warning an error, as ``python -W error -m compileall`` would."""

import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for top in ("rdrop_fairseq", "benchmarks", "experiments", "tests")
                 for p in (REPO / top).rglob("*.py"))


def test_there_are_sources_to_compile():
    assert len(SOURCES) > 100 and REPO / "rdrop_fairseq" / "__init__.py" in SOURCES


@pytest.mark.parametrize("top", ["rdrop_fairseq", "benchmarks", "experiments", "tests"])
def test_compiles_without_a_warning(top):
    failures = []
    for path in (p for p in SOURCES if p.relative_to(REPO).parts[0] == top):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
            except (SyntaxError, Warning) as e:
                failures.append(f"{path.relative_to(REPO)}: {e}")
    assert not failures, "\n".join(failures)
