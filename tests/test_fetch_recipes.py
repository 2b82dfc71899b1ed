"""Each recipe's ``prepare`` from nothing: the inputs fetched from a loopback server (the
source table replaced with ``RDROP_SOURCES``) as tiny archives in the real layouts: the
WikiText zip, the IWSLT tgz, a GLUE task zip and MRPC's SentEval files, GPT-2's BPE files,
a bart.large tarball with its dict.txt and CNN/DailyMail's parquet files. Inputs the user
sets are used as they are; OFFLINE=1 names what is missing; nothing is fetched twice."""

import hashlib
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from rdrop_fairseq.recipes import prepare_glue
from tests.test_fetch import NO_PROXY, Route, Server
from tests.warm_process import fairseq_bin, machine_env, run_command

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a house garden river city old new runs sleeps music road green small".split()


@pytest.fixture
def server():
    srv = Server()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def serve(server, tmp_path, entries):
    """Put each entry's files on the server; a table (``RDROP_SOURCES``) that points to them
    with their SHA-256s, as the packaged one does with the real files'."""
    table = {}
    for name, (files, extra) in entries.items():
        specs = []
        for fname, data in files.items():
            server.routes[f"/{fname}"] = Route(data=data)
            specs.append({"name": fname, "urls": [server.url(f"/{fname}")], "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
        table[name] = {"files": specs, "licence": "test", "used_by": "test", **extra}
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(table))
    return path


def script(cwd, name, *args, ok=True, **env):
    """scripts/NAME.sh run in ``cwd`` (its default work/ folder there), fairseq's tools and
    the recipes' ``python3 -m`` warm (tests/warm_process.py; not in a dry run)."""
    warm = [] if env.get("DRY_RUN") else [fairseq_bin()]
    path = os.pathsep.join([*warm, str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    full_env = {**machine_env(), "PATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "HOME": "/tmp", "PYTHONUNBUFFERED": "1",
                "GPUS": "0", "FAIRSEQ_BIN": fairseq_bin(), **NO_PROXY,
                **{k: str(v) for k, v in env.items()}}
    proc = run_command(["bash", REPO / "scripts" / f"{name}.sh", *map(str, args)], cwd,
                       full_env, 300)
    proc.output = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0, proc.output[-5000:]
    return proc


def zip_bytes(files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


def tgz_bytes(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            data = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def lines(n, seed):
    return [" ".join(WORDS[(seed + i * 7 + k) % len(WORDS)] for k in range(4 + i % 3))
            for i in range(n)]


def test_wikitext103_prepare_fetches_the_zip_once(server, tmp_path):
    corpus = {split: "\n".join(lines(n, i)) + "\n"
              for i, (split, n) in enumerate([("train", 40), ("valid", 5), ("test", 5)])}
    table = serve(server, tmp_path, {"wikitext-103": ({"wikitext-103-v1.zip": zip_bytes(
        {f"wikitext-103/wiki.{s}.tokens": text for s, text in corpus.items()})}, {})})
    for _ in range(2):
        log = script(tmp_path, "wikitext103", "prepare", RDROP_SOURCES=table).output
    assert [r["path"] for r in server.log] == ["/wikitext-103-v1.zip"]  # verified, kept
    assert "sha256 verified" in log
    assert (tmp_path / "work" / "downloads" / "wikitext-103-v1.zip").is_file()
    assert (tmp_path / "work" / "wikitext-103" / "bin" / "train.bin").is_file()


def test_iwslt14_prepare_fetches_the_de_en_archive(server, tmp_path):
    files = {}
    for lang, word in (("de", "Haus"), ("en", "House")):
        files[f"de-en/train.tags.de-en.{lang}"] = "\n".join(
            ["<url>http://www.ted.com/talks/x</url>", "<talkid>1</talkid>"]
            + [f"{word} {line} ." for line in lines(46, 1)]) + "\n"
        for name in ("IWSLT14.TED.dev2010", "IWSLT14.TED.tst2010"):
            files[f"de-en/{name}.de-en.{lang}.xml"] = (
                f'<doc>\n<seg id="1"> {word} {name} </seg>\n</doc>\n')
    table = serve(server, tmp_path, {"iwslt14-de-en": ({"de-en.tgz": tgz_bytes(files)}, {})})
    script(tmp_path, "iwslt14", "prepare", "--bpe-merges", 20, RDROP_SOURCES=table)
    data = tmp_path / "work" / "iwslt14.de-en"
    assert (data / "bin" / "dict.de.txt").is_file()
    assert (data / "raw" / "test.en").read_text().split("\n")[0] == "House IWSLT14.TED.dev2010"


def glue_sources(tmp_path):
    """An RTE zip as GLUE's host serves it, MRPC's SentEval files, and GPT-2's BPE files."""
    from tests.test_glue_recipe import write_gpt2_bpe

    rows = {split: [f"{i}\t{a}\t{b}\t{'entailment' if i % 2 else 'not_entailment'}"
                    for i, (a, b) in enumerate(zip(lines(n, 2), lines(n, 3)))]
            for split, n in (("train", 16), ("dev", 8))}
    rte = zip_bytes({f"RTE/{split}.tsv": "index\tsentence1\tsentence2\tlabel\n"
                     + "\n".join(r) + "\n" for split, r in rows.items()})
    bpe = write_gpt2_bpe(tmp_path / "bpe-src", WORDS)
    msr = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\r\n"
    train = msr + "".join(f"{i % 2}\t{100 + i}\t{200 + i}\t{a}\t{b}\r\n"
                          for i, (a, b) in enumerate(zip(lines(12, 4), lines(12, 5))))
    test = msr + "".join(f"{i % 2}\t{300 + i}\t{400 + i}\t{a}\t{b}\r\n"
                         for i, (a, b) in enumerate(zip(lines(4, 6), lines(4, 7))))
    dev_ids = "".join(f"{100 + i}\t{200 + i}\n" for i in (1, 5, 9))
    return {"glue-RTE": ({"RTE.zip": rte}, {"make": "unpack", "local": "set GLUE_DIR to yours"}),
            "glue-MRPC": ({"msr_paraphrase_train.txt": train.encode(),
                           "msr_paraphrase_test.txt": test.encode(),
                           "mrpc_dev_ids.tsv": dev_ids.encode()},
                          {"make": "rdrop_fairseq.recipes.prepare_glue:mrpc_from_downloads"}),
            "gpt2-bpe": ({n: (bpe / n).read_bytes() for n in ("encoder.json", "vocab.bpe",
                                                               "dict.txt")}, {"make": "copy"})}


def test_glue_prepare_fetches_the_task_and_the_bpe(server, tmp_path):
    table = serve(server, tmp_path, glue_sources(tmp_path))
    script(tmp_path, "glue", "prepare", TASK="RTE", RDROP_SOURCES=table)
    work = tmp_path / "work"
    assert sorted(p.name for p in (work / "glue_data" / "RTE").iterdir()) == ["dev.tsv",
                                                                                "train.tsv"]
    assert sorted(p.name for p in (work / "gpt2_bpe").iterdir()) == [
        "dict.txt", "encoder.json", "vocab.bpe"]
    assert (work / "glue-bin" / "RTE-bin" / "input1" / "train.bin").is_file()
    # MRPC, built from SentEval's files as GLUE's download script builds it
    script(tmp_path, "glue", "prepare", TASK="MRPC", RDROP_SOURCES=table)
    mrpc = work / "glue_data" / "MRPC"
    dev = prepare_glue.read_split("MRPC", mrpc, "dev")
    train = prepare_glue.read_split("MRPC", mrpc, "train")
    assert len(dev) == 3 and len(train) == 9 and len(prepare_glue.read_split(
        "MRPC", mrpc, "test")) == 4
    assert dev[0] == ((lines(12, 4)[1], lines(12, 5)[1]), "1")
    assert (mrpc / "test.tsv").read_text().split("\n")[1].split("\t")[:3] == ["0", "300", "400"]
    assert (work / "glue-bin" / "MRPC-bin" / "label" / "dict.txt").is_file()
    assert [r["path"] for r in server.log].count("/encoder.json") == 1  # kept for MRPC


def test_glue_train_fetches_roberta_unless_from_scratch_or_given(tmp_path):
    def fetched(**env):
        out = script(tmp_path, "glue", "train", TASK="RTE", DRY_RUN=1, **env).stdout
        return [line.split(" -> ")[0][9:] for line in out.splitlines() if line.startswith("++ fetch")]

    assert fetched() == ["https://dl.fbaipublicfiles.com/fairseq/models/roberta.large.tar.gz"]
    assert fetched(MODE="attendout") == [
        "https://dl.fbaipublicfiles.com/fairseq/models/roberta.base.tar.gz"]
    assert fetched(FROM_SCRATCH=1) == [] and fetched(ROBERTA_DIR=tmp_path / "mine") == []


def test_cnndm_prepare_builds_the_text_from_parquet_and_unpacks_bart(server, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.test_summarization_recipe import write_bart_dict, write_gpt2_bpe

    articles = {s: lines(n, i) for i, (s, n) in enumerate([("train", 6), ("validation", 2),
                                                              ("test", 2)])}
    files = {}
    for split, texts in articles.items():
        buf = io.BytesIO()
        pq.write_table(pa.table({"article": [f"{t} .\n" for t in texts],
                                 "highlights": [f"{t} .\nsecond highlight ." for t in texts],
                                 "id": [str(i) for i in range(len(texts))]}), buf)
        files[f"cnndm-{split}-00000-of-00001.parquet"] = buf.getvalue()
    text = "\n".join(t for texts in articles.values() for t in texts) + " . second highlight"
    encoder_json, vocab_bpe, _ = write_gpt2_bpe(tmp_path / "bpe-src", text)
    write_bart_dict(tmp_path / "bpe-src" / "dict.txt", encoder_json, vocab_bpe, text)
    bart = tgz_bytes({"bart.large/dict.txt": (tmp_path / "bpe-src" / "dict.txt").read_bytes(),
                      "bart.large/model.pt": b"weights", "bart.large/NOTE": "a tarball"})
    table = serve(server, tmp_path, {
        "cnn_dailymail": (files, {"make": "rdrop_fairseq.recipes.prepare_cnndm:from_parquet"}),
        "gpt2-bpe": ({n: (tmp_path / "bpe-src" / n).read_bytes() for n in
                      ("encoder.json", "vocab.bpe")}, {"make": "copy"}),
        "bart.large": ({"bart.large.tar.gz": bart}, {"make": "unpack"})})
    script(tmp_path, "cnndm_bart", "prepare", RDROP_SOURCES=table)
    work = tmp_path / "work"
    assert (work / "cnn_dm" / "val.source").read_text().splitlines() == [
        f"{t} . " for t in articles["validation"]]  # one line each, the newline a space
    assert (work / "cnn_dm" / "train.target").read_text().splitlines()[0] == \
        f"{articles['train'][0]} . second highlight ."
    assert sorted(p.name for p in (work / "bart.large").iterdir()) == ["NOTE", "dict.txt",
                                                                       "model.pt"]
    assert (work / "cnn_dm-bin" / "bin" / "train.source-target.source.bin").is_file()


def _sgm(segments):
    return "<refset>\n<doc docid=\"x\">\n" + "".join(
        f'<seg id="{i}">{seg}</seg>\n' for i, seg in enumerate(segments, 1)) + "</doc>\n"


def test_wmt16_regenerate_fetches_the_statmt_archives_and_remakes_googles_files(server,
                                                                                tmp_path):
    """GOOGLE=regenerate: google/seq2seq's wmt16_en_de.sh steps on tiny stand-ins of its five
    archives: the corpora concatenated, SGML test sets as input-from-sgm.perl reads them,
    Moses tokenisation with XML escaping, clean-corpus-n 1-80 (ratio 9), a joint BPE as
    subword-nmt learnt and applied it in early 2017."""
    de, en = lines(40, 8), lines(40, 9)
    de[0], en[0] = 'Er sagte "ja" & ging.', 'He said "yes" & left, it\'s [old].'
    de[1], en[1] = " ".join(["Haus"] * 81), " ".join(["house"] * 81)  # > 80 tokens
    de[2], en[2] = "Haus", " ".join(["house"] * 10)  # ratio 10 > 9
    de[3], en[3] = "", "house"  # an empty side
    parts = {"europarl": (0, 20), "commoncrawl": (20, 30), "nc": (30, 40)}
    corpus = {"europarl": "europarl-v7.de-en", "commoncrawl": "commoncrawl.de-en",
              "nc": "training-parallel-nc-v11/news-commentary-v11.de-en"}

    def archive(key):
        lo, hi = parts[key]
        return tgz_bytes({f"{corpus[key]}.{lang}": "".join(x + "\n" for x in text[lo:hi])
                          for lang, text in (("de", de), ("en", en))})

    tests = {year: (lines(3, year), lines(3, year + 1)) for year in (2014, 2015, 2016)}
    dev = {"dev/newstest2013.de": "Das Haus .\nEin Auto\n",
           "dev/newstest2013.en": "The house .\nA car\n"}
    for year in (2014, 2015):
        dev[f"dev/newstest{year}-deen-src.de.sgm"] = _sgm(tests[year][0])
        dev[f"dev/newstest{year}-deen-ref.en.sgm"] = _sgm(tests[year][1])
    # input-from-sgm.perl: white space runs made one space; a segment over two lines joined
    dev["dev/newstest2014-deen-src.de.sgm"] = _sgm(["  das   alte\tHaus  ", "zwei\nZeilen",
                                                     tests[2014][0][2]])
    table = serve(server, tmp_path, {
        "europarl-v7-de-en": ({"europarl-v7-de-en.tgz": archive("europarl")}, {}),
        "wmt13-commoncrawl": ({"training-parallel-commoncrawl.tgz": archive("commoncrawl")}, {}),
        "wmt16-nc-v11": ({"training-parallel-nc-v11.tgz": archive("nc")}, {}),
        "wmt16-dev": ({"wmt16-dev.tgz": tgz_bytes(dev)}, {}),
        "wmt16-test": ({"wmt16-test.tgz": tgz_bytes({
            "test/newstest2016-deen-src.de.sgm": _sgm(tests[2016][0]),
            "test/newstest2016-deen-ref.en.sgm": _sgm(tests[2016][1])})}, {})})
    log = script(tmp_path, "wmt14", "prepare", "--workers", 1, GOOGLE="regenerate",
                 RDROP_SOURCES=table).output
    work = tmp_path / "work"
    google = work / "wmt16_en_de_regenerated"
    tok = {lang: (google / f"train.tok.clean.{lang}").read_text().splitlines()
           for lang in ("de", "en")}
    assert len(tok["de"]) == len(tok["en"]) == 37  # the three pairs cleaned out
    assert "cleaned: 37 of 40 training pairs kept" in log
    assert tok["en"][0] == "He said &quot; yes &quot; &amp; left , it &apos;s &#91; old &#93; ."
    assert tok["de"][0] == "Er sagte &quot; ja &quot; &amp; ging ."
    assert tok["de"][-1] == de[-1]  # news commentary last, as the script concatenates
    assert (google / "newstest2014.tok.de").read_text().splitlines()[:2] == [
        "das alte Haus", "zweiZeilen"]
    assert (google / "newstest2016.tok.en").read_text().splitlines() == tests[2016][1]
    assert (google / "newstest2013.tok.en").read_text().splitlines() == ["The house .", "A car"]
    # the codes of subword-nmt as of early 2017: no "#version: 0.2", "</w>" a symbol of its own
    codes = (google / "bpe.32000").read_text().splitlines()
    assert codes and not codes[0].startswith("#") and " </w>" in [c[1:] for c in codes]
    bpe = (google / "train.tok.clean.bpe.32000.en").read_text().splitlines()
    assert len(bpe) == 37 and [line.replace("@@ ", "") for line in bpe] == tok["en"]
    for year in (2013, 2014, 2015, 2016):
        assert (google / f"newstest{year}.tok.bpe.32000.de").is_file()
    data = work / "wmt16-regenerated.en-de"
    assert (data / "bin" / "test.en-de.de.bin").is_file()  # binarised as GOOGLE=DIR does
    assert [r["path"] for r in server.log] == [
        "/europarl-v7-de-en.tgz", "/training-parallel-commoncrawl.tgz",
        "/training-parallel-nc-v11.tgz", "/wmt16-dev.tgz", "/wmt16-test.tgz"]
    shutil.rmtree(data)
    log = script(tmp_path, "wmt14", "prepare", GOOGLE="regenerate", RDROP_SOURCES=table).output
    assert "holds the regenerated files already" in log and len(server.log) == 5
    assert (data / "bin" / "dict.en.txt").is_file()


def test_inputs_the_user_sets_are_used_as_they_are(server, tmp_path):
    table = serve(server, tmp_path, glue_sources(tmp_path))
    mine = tmp_path / "mine"
    proc = script(tmp_path, "glue", "prepare", ok=False, TASK="RTE", GLUE_DIR=mine,
                  RDROP_SOURCES=table)
    assert proc.returncode != 0 and "mine/RTE/train.tsv not found: GLUE_DIR must hold" \
        in proc.stderr
    assert server.log == [] and not mine.exists() and not (tmp_path / "work").exists()
    orig = tmp_path / "orig"
    orig.mkdir()
    proc = script(tmp_path, "wmt14", "prepare", ok=False, ORIG=orig)
    assert proc.returncode != 0 and "lacks training-parallel-europarl-v7.tgz" in proc.stderr
    assert "rdrop_fairseq.recipes.fetch --dir" in proc.stderr and list(orig.iterdir()) == []


def test_offline_names_every_missing_input_and_how_to_fetch_it(server, tmp_path):
    table = serve(server, tmp_path, glue_sources(tmp_path))
    proc = script(tmp_path, "glue", "prepare", ok=False, TASK="RTE", OFFLINE=1,
                  RDROP_SOURCES=table)
    assert proc.returncode != 0 and server.log == []
    for name in ("RTE.zip", "encoder.json", "vocab.bpe", "dict.txt"):
        assert f"work/downloads/{name} is missing: it comes from {server.url('/' + name)}" \
            in proc.stderr
        assert f"--out {tmp_path}/work/downloads/{name} {server.url('/' + name)}" in proc.stderr
    assert "or set GLUE_DIR to yours" in proc.stderr
    assert not (tmp_path / "work").exists()


def test_the_docs_print_the_source_table():
    doc = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    assert fetch_mod.markdown_table(fetch_mod.load_sources(fetch_mod.TABLE)) in doc


def test_every_fetch_command_the_docs_show_runs(tmp_path, monkeypatch, capsys):
    """Each ``python -m rdrop_fairseq.recipes.fetch`` line of docs/data.md, parsed and run
    by the command line as a dry run (DRY_RUN=1: nothing fetched, nothing written)."""
    from rdrop_fairseq.recipes.fetch.__main__ import main

    doc = (REPO / "docs" / "data.md").read_text(encoding="utf-8").replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in doc.splitlines()
                if line.startswith("python -m rdrop_fairseq.recipes.fetch ")]
    assert [c[3] for c in commands] == ["--sha256", "--dir", "--list"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.delenv("RDROP_SOURCES", raising=False)
    for command in commands:
        assert main(command[3:]) is None, command
    out = capsys.readouterr().out
    assert "++ fetch https://wikitext.smerity.com/wikitext-103-v1.zip -> wikitext-103-v1.zip" \
        in out
    assert "-> work/downloads/RTE.zip" in out and "++ make work/glue_data/RTE (unpack)" in out
    assert "-> work/downloads/encoder.json" in out and "| source | file |" in out
    assert list(tmp_path.iterdir()) == []


WMT_EN_DE = ["wmt13-europarl-v7", "wmt13-commoncrawl", "wmt17-nc-v12", "wmt14-test-full"]


@pytest.mark.parametrize("name, env, sources", [
    ("wikitext103", {}, ["wikitext-103"]),
    ("iwslt14", {"SRC": "en", "TGT": "de"}, ["iwslt14-de-en"]),
    ("iwslt14", {"SRC": "zh", "TGT": "en"}, ["iwslt17-en-zh"]),
    ("wmt14", {}, WMT_EN_DE),
    ("wmt14", {"GOOGLE": "regenerate"}, ["europarl-v7-de-en", "wmt13-commoncrawl",
                                         "wmt16-nc-v11", "wmt16-dev", "wmt16-test"]),
    ("wmt14", {"PAIR": "en-fr"}, ["wmt13-europarl-v7", "wmt13-commoncrawl", "wmt13-un",
                                  "wmt14-nc-v9", "wmt10-giga-fren", "wmt14-test-full"]),
    ("glue", {"TASK": "QQP"}, ["glue-QQP", "gpt2-bpe"]),
    ("cnndm_bart", {}, ["cnn_dailymail", "gpt2-bpe", "bart.large"]),
    ("glue_bert", {"TASK": "MRPC"}, ["glue-MRPC", "bert-base-uncased"]),
    ("vit", {}, ["cifar-100"]),
])
def test_a_dry_run_prints_every_url_and_destination(tmp_path, name, env, sources):
    from tests.recipe_helpers import dry_run

    _, proc = dry_run(name, "prepare", GPUS=0, DOWNLOADS=tmp_path / "dl",
                      DATA_DIR=tmp_path / "data", **env)
    folder = tmp_path / ("wmt14-orig" if name == "wmt14" else "dl")
    table = fetch_mod.load_sources(fetch_mod.TABLE)
    def url(entry, spec):
        return spec["urls"][0] if "urls" in spec else fetch_mod.hub_url(entry["hub"],
                                                                          spec["path"])

    assert proc.fetches == [(url(table[source], f), str(folder / f["name"]))
                            for source in sources for f in table[source]["files"]]
    assert list(tmp_path.iterdir()) == []
