"""What the user docs say against what the code, the scripts and the other docs say: the
figures a page quotes from another, the files a command runs, what ran on a GPU, and no
references a user cannot look up (the project's own issue numbers). The figures that come
from running code are checked where the code runs: tests/test_hot_path.py (the op counts
of docs/benchmarks.md), tests/test_plain_pytorch.py (docs/plain-pytorch.md's tables)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
USER_DOCS = [REPO / "README.md", REPO / "experiments" / "README.md", *sorted(DOCS.glob("*.md"))]


def text(path):
    return Path(path).read_text(encoding="utf-8")


def test_user_docs_cite_no_issue_a_user_cannot_look_up():
    """Upstream issues are named with their number (``fairseq issue #5410``); the project's
    own ("issue 14", "the issue asks") are not a user's to look up."""
    found = [(p.name, m[0]) for p in USER_DOCS
             for m in re.finditer(r".{0,40}\b[Ii]ssues?\b(?!\s+#\d).{0,20}", text(p))]
    assert found == []


def test_no_doc_says_nothing_ran_on_a_gpu():
    """The H100 results are in docs/benchmarks.md: a page may say what did not run on a
    GPU, not that the project has had none."""
    assert (REPO / "benchmarks" / "results").is_dir()
    never = re.compile(r"(?:has|have|had) (?:had )?no GPUs?|no GPUs? in this project|"
                       r"for lack of GPUs?|project has no GPUs?", re.I)
    assert [(p.name, m[0]) for p in USER_DOCS for m in never.finditer(text(p))] == []
    readme = text(REPO / "README.md")
    assert "H100" in readme and "docs/benchmarks.md#gpu-one-nvidia-h100" in readme


def test_the_fast_tier_runs_the_files_testing_md_lists():
    script = text(REPO / "scripts" / "test.sh")
    block = script[script.index('set -- -m "not slow"'):]
    block = block[:block.index('"$@"')]
    run = set(re.findall(r"tests/(test_\w+\.py)", block))
    doc = text(DOCS / "testing.md")
    paragraph = doc[doc.index("**The core tier**"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert set(re.findall(r"`(test_\w+\.py)`", paragraph)) == run


def test_the_readme_starts_with_the_commands_then_how_to_use_the_plugin():
    readme = text(REPO / "README.md")
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S)[1].splitlines()
    assert first_block[0].startswith("bash scripts/demo.sh")
    assert first_block[1].startswith("bash scripts/test.sh")
    use = readme[readme.index("\n## "):]
    assert use.startswith("\n## Use it\n"), use[:40]
    use = use[:use.index("\n## ", 1)]
    for what in ("pip install -e .", "--user-dir $USER_DIR", "python -m rdrop_fairseq --options"):
        assert what in use, what
    # no commit hashes or the project's own wording on the front page
    assert re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", readme) == []
    assert re.findall(r"\blent\b|\bsessions?\b|this project's", readme) == []


def test_the_readme_attendout_cell_is_short_and_says_where_it_ran():
    readme = text(REPO / "README.md")
    (row,) = [line for line in readme.splitlines() if line.startswith("| AttendOut")]
    cell = row.split(" | ")[-1]
    assert len(cell) < 200 and cell.endswith("([details](docs/attendout-results.md)) |"), cell
    results = text(DOCS / "attendout-results.md")
    if "H100" in results:  # trained (in part) on a GPU: not a CPU figure
        assert "**CPU**" not in cell
    if "attendout_layer" in results:  # the whole-layer gate's arm was run
        assert "before the gate existed" not in readme


def durations(line):
    """``["3m43s", "7.1 minutes", ...]``; "3.7 and 7.1 minutes" gives both."""
    found = re.findall(r"\d+m\d\ds", line)
    for numbers in re.findall(r"(\d+(?:\.\d+)?(?:,?\s+(?:and|or|to)\s+\d+(?:\.\d+)?)*)\s+minutes",
                              line):
        found += [f"{n} minutes" for n in re.findall(r"\d+(?:\.\d+)?", numbers)]
    return found


def test_quoted_run_times_are_the_measured_ones():
    """The demo's, --quick's and the toy task's times quoted elsewhere are those of the
    times table of docs/results.md, which gives each one's command."""
    results = text(DOCS / "results.md")
    table = results[results.index("## Times"):]
    table = table[:table.index("\n## ")]
    demo = text(DOCS / "demo.md")
    quick = demo[demo.index("`--quick`"):]
    quick = quick[:quick.index(". ", quick.index("minutes"))]
    toy = [line for line in text(REPO / "experiments" / "README.md").splitlines()
           if line.startswith("| `toy_demo`")]
    for quoted in (quick, *toy):
        assert durations(quoted), quoted
        for duration in durations(quoted):
            assert duration in table, (duration, quoted)


def test_each_experiments_results_page_is_named_where_experiments_say_so():
    readme = text(REPO / "experiments" / "README.md")
    where = re.search(r"results are in (.*?)\.\n", readme, re.S)[1]
    pages = {p.name for p in DOCS.glob("*results*.md")}
    assert {p for p in pages if f"docs/{p}" in where} == pages, where


def test_the_readmes_first_command_is_named_as_what_it_runs():
    """Pages that call something "the README's first command" mean the demo it runs."""
    for page in USER_DOCS:
        body = text(page)
        for m in re.finditer(r"README's first command", body):
            around = body[max(0, m.start() - 300):m.end() + 300]
            assert "scripts/demo.sh" in around and "toy" not in around, (page.name, around)


def test_testing_md_is_a_guide_not_a_log():
    """One current time per tier, at most two dates (link anchors included) besides the
    last result on each Python (one row, one date each); the history of runs is git's:
    docs/development.md, which testing.md links, is a guide for contributors, with no
    run's date, commit or time."""
    doc = text(DOCS / "testing.md")
    pythons = [line for line in doc.splitlines() if line.startswith("| Python 3.")]
    assert len(pythons) >= 2
    assert all(len(re.findall(r"\d{4}-\d\d-\d\d", row)) == 1 for row in pythons), pythons
    rest = "\n".join(line for line in doc.splitlines() if line not in pythons)
    assert len(re.findall(r"\d{4}-\d\d-\d\d", rest)) <= 2
    table = [line for line in doc.splitlines() if line.startswith("| the ")]
    assert [row.split(" | ")[0] for row in table] == [
        "| the whole suite", "| the core tier", "| the CUDA tests"]
    assert "](development.md)" in doc
    development = text(DOCS / "development.md")
    commit = r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
    assert re.findall(rf"\d{{4}}-\d\d-\d\d|{commit}|\d+m\d\ds", development) == []


def test_huggingface_md_gives_its_evidence_in_one_table_of_files_that_exist():
    doc = text(DOCS / "huggingface.md")
    section = doc[doc.index("\n## What the tests show\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == "| setting | test file | what it shows |" and len(rows) > 10
    named = {f for row in rows[2:] for f in re.findall(r"`(tests/\w+\.py)`", row.split(" | ")[1])}
    assert named and all((REPO / f).is_file() for f in named), named
    # the usage comes first: the table follows the sections a user reads to train
    assert doc.index("## Install and train") < doc.index("## A loop of your own") \
        < doc.index("## What the tests show")
