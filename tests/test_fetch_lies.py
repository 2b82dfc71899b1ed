"""The downloader against servers that lie and paths that are not files: a 206 that ignores
If-Range, compression nobody asked for, portal pages in disguise, a Content-Length that is
not the pinned size, a Retry-After that is no time; an --out at a FIFO or a device, a lock
that cannot be made; credentials in URLs, a table nested too deep, archives refused or cut.
Against the loopback servers of tests/test_fetch.py."""

import gzip
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from tests.test_fetch import (DATA, REPO, SHA, Route, a_new_run, cli, only,  # noqa: F401
                              server, table_for)
from tests.test_fetch_edges import one_line

NEW = DATA[::-1]  # the host's file once it changed
DATE, NEW_DATE = "Mon, 01 Jan 2024 00:00:00 GMT", "Tue, 02 Jan 2024 00:00:00 GMT"


def fetched_by_table(server, tmp_path, name, **spec):
    """``name`` fetched with ``--dir`` from a table entry without a public record (as GPT-2's
    BPE files are): the process, and the file's path."""
    table = table_for(server, tmp_path, {"src": {"files": [
        {"name": name, "urls": [server.url(f"/{name}")], "no_public_record": "a test", **spec}]}})
    return cli("--dir", tmp_path / "dl", "src", env={"RDROP_SOURCES": str(table)}), \
        tmp_path / "dl" / name


def a_record(url, validator, total=len(DATA)):
    """What a download leaves beside FILE.partial for its resume: the URL it came from, its
    validator and the file's size as first announced."""
    return json.dumps({"url": url, "total": total, "validator": validator})


def requests_made(server):
    return [(r["range"], r["if_range"]) for r in server.log]


# ------------------------------------------------------------------ a wrong file kept


@pytest.mark.parametrize("old, new", [
    ({"etag": '"v1"'}, {"etag": '"v2"'}),
    ({"last_modified": DATE}, {"last_modified": NEW_DATE}),
    ({"etag": '"v1"'}, {}),  # a 206 that carries no validator at all
], ids=["ETag", "Last-Modified", "none"])
def test_a_206_without_the_validator_asked_for_starts_afresh(server, tmp_path, old, new):
    """The host's file changes after the cut, and its server answers the resume with a 206
    of the new file, ignoring If-Range."""
    server.routes["/encoder.json"] = Route(data=DATA, cut=300_000, **old, then=Route(
        data=NEW, ignore_if_range=True, **new))
    proc, out = fetched_by_table(server, tmp_path, "encoder.json")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == NEW  # not OLD[:300000] + NEW[300000:]
    sent = next(iter(old.values()))
    assert requests_made(server) == [(None, None), ("bytes=300000-", sent), (None, None)]
    assert "ignores If-Range" in proc.stderr


@pytest.mark.parametrize("name", ["encoder.json", "corpus.tar"])
def test_a_file_gzipped_on_the_way_is_saved_decoded(server, tmp_path, name):
    data = DATA if name.endswith(".json") else tar_of({"corpus/a.txt": DATA})
    server.routes[f"/{name}"] = Route(data=data, gzip=True, etag='"v1"')
    proc, out = fetched_by_table(server, tmp_path, name)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data  # not its gzip
    assert only(out) == [name]


def test_a_cut_decoded_download_starts_again_rather_than_resumes(server, tmp_path):
    """The server gzips on the way and serves ranges of the gzipped bytes: what was saved
    (decoded) cannot be resumed against them."""
    # 640 kB that gzip does not shrink: the resume asks for a range inside the gzipped bytes
    data = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(20_000))
    server.routes["/encoder.json"] = Route(data=data, gzip=True, etag='"v1"', cut=300_000)
    proc, out = fetched_by_table(server, tmp_path, "encoder.json")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == data
    (first, _), (resumed, sent), last = requests_made(server)
    assert first is None and last == (None, None)  # the whole file asked for again
    assert resumed.startswith("bytes=") and sent == '"v1"'
    assert "ranges count compressed bytes" in proc.stderr


@pytest.mark.parametrize("name, encoding, says", [
    # a .gz labelled gzip: the server's label of the file's own compression, or a second
    # compression? Without a checksum nothing tells
    ("notes.txt.gz", "gzip", "cannot tell"),
    ("encoder.json", "br", "Content-Encoding: br"),
    ("encoder.json", "gzip, gzip", "Content-Encoding: gzip, gzip"),
])
def test_a_compression_that_cannot_be_told_apart_is_refused(server, tmp_path, name, encoding,
                                                            says):
    body = gzip.compress(DATA, mtime=0)
    server.routes[f"/{name}"] = Route(data=body, encoding=encoding)
    proc = cli("--out", tmp_path / name, server.url(f"/{name}"))
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr
    assert only(tmp_path / name) == []
    # with a checksum, a .gz labelled gzip is kept as served: the checksum tells
    if name.endswith(".gz"):
        proc = cli("--sha256", hashlib.sha256(body).hexdigest(), "--out", tmp_path / name,
                   server.url(f"/{name}"))
        assert proc.returncode == 0 and (tmp_path / name).read_bytes() == body


def test_a_tarball_gzipped_twice_on_the_way_is_refused_as_corrupt(server, tmp_path):
    tgz = gzip.compress(tar_of({"m/model.pt": DATA}), mtime=0)
    server.routes["/m.tar.gz"] = Route(data=gzip.compress(tgz, mtime=0), encoding="gzip")
    proc = cli("--out", tmp_path / "m.tar.gz", server.url("/m.tar.gz"))
    assert proc.returncode == 1 and "a corrupt archive" in proc.stderr
    server.routes["/m.tar.gz"] = Route(data=tgz, encoding="gzip")  # only labelled: the file
    assert cli("--out", tmp_path / "m.tar.gz", server.url("/m.tar.gz")).returncode == 0
    assert (tmp_path / "m.tar.gz").read_bytes() == tgz


XHTML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML '
         b'1.0 Strict//EN" "http://www.w3.org/TR/xhtml1/DTD/xhtml1-strict.dtd">\n<html>')
PAGES = {
    "text/html": Route(data=b"<p>quota exceeded</p>", html=True),
    "a byte-order mark": Route(data=b"\xef\xbb\xbf<!DOCTYPE html><p>sign in</p>"),
    "XHTML": Route(data=XHTML, type="application/xhtml+xml"),
    "XHTML as octet-stream": Route(data=b'<?xml version="1.0"?>\n<html xmlns="x">sign in'),
    "a comment first": Route(data=b"<!-- portal 3.1 -->\n<!-- login -->\n<html><body>in"),
    "Text/HTML": Route(data=b"sign in, please", type="Text/HTML; charset=UTF-8"),
}


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("when", ["first", "resume"])
def test_a_portal_page_is_refused_and_a_partial_file_kept(server, tmp_path, page, when):
    server.routes["/encoder.json"] = Route(PAGES[page])
    partial = tmp_path / "encoder.json.partial"
    validator = tmp_path / "encoder.json.partial.validator"
    if when == "resume":  # 600 kB of a good download, and its validator, from this URL
        partial.write_bytes(DATA[:600_000])
        validator.write_text(a_record(server.url("/encoder.json"), '"v1"'))
    proc = cli("--out", tmp_path / "encoder.json", server.url("/encoder.json"))
    assert proc.returncode == 1 and "an HTML page" in proc.stderr, proc.stderr
    if when == "resume":
        assert server.log[0]["range"] == "bytes=600000-"
        assert partial.read_bytes() == DATA[:600_000]  # as it was
        assert validator.read_text() == a_record(server.url("/encoder.json"), '"v1"')
    else:
        assert only(partial) == []


def test_a_refused_answer_to_a_resume_leaves_the_partial_file(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, no_length=True)  # no length, no checksum
    partial = tmp_path / "a.bin.partial"
    partial.write_bytes(DATA[:600_000])
    (tmp_path / "a.bin.partial.validator").write_text(a_record(server.url("/a.bin"), '"v1"'))
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 1 and "no Content-Length" in proc.stderr
    assert partial.read_bytes() == DATA[:600_000]


# ------------------------------------------------------------------ paths that are not files


def test_an_out_that_is_not_a_regular_file_is_refused_before_anything_is_written(server,
                                                                                 tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = one_line(cli("--out", fifo, server.url("/a.bin")))
    assert f"{fifo} is a FIFO, not a regular file" in line
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and only(fifo) == ["fifo"]
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"] and server.log == []
    # a device: with OFFLINE=1, so that a downloader that took it for a missing file would
    # stop before writing anything there
    line = one_line(cli("--out", "/dev/null", server.url("/a.bin"), env={"OFFLINE": "1"}))
    assert "/dev/null is a character device, not a regular file" in line
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("out", ["/proc/self/x", "/proc/rdrop-test-x"])
def test_a_lock_that_cannot_be_made_is_one_line_not_a_wait(out):
    line = one_line(cli("--out", out, "http://127.0.0.1:9/x", timeout=20))
    assert f"cannot write {os.path.dirname(out)} (No such file or directory)" in line


# ------------------------------------------------------------------ smaller


def test_a_content_length_other_than_the_pinned_size_is_refused_before_the_body(server,
                                                                                tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    with pytest.raises(fetch_mod.FetchError, match=f"the server announces {len(DATA)} bytes, "
                                                   "not the 1000 pinned"):
        fetch_mod.fetch([server.url("/a.bin")], tmp_path / "a.bin", size=1000, sha256=SHA)
    assert only(tmp_path / "a.bin") == []  # nothing downloaded, nothing kept aside


def test_credentials_in_a_url_are_masked_in_every_message(server, tmp_path):
    url = server.url("/gone.bin").replace("://", "://user:s3cret@")
    for args, env in [([url], {}),  # a 404: every URL named, and how to fetch it by hand
                      (["http://user:s3cret@127.0.0.1:9/x"], {}),  # no connection
                      ([url], {"OFFLINE": "1"}), ([url], {"DRY_RUN": "1"}),
                      (["http://user:s3cret@[::1"], {})]:  # not a URL
        proc = cli("--out", tmp_path / "a.bin", *args, env=env)
        text = proc.stdout + proc.stderr
        assert "s3cret" not in text and "://***@" in text, text
    proc = cli("--out", tmp_path / "a.bin", url)
    assert "fetch it by hand" in proc.stderr.lower() and "a.bin: from http://***@" in proc.stderr


def test_a_table_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "t.json").write_text("[" * 100_000 + "]" * 100_000)
    line = one_line(cli("--list", env={"RDROP_SOURCES": str(tmp_path / "t.json")}))
    assert line.startswith(f"error: cannot read the source table {tmp_path / 't.json'}: ")


def tar_of(files, links=()):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


TRAIN = {"de-en/train.tags.de-en.de": b"Haus .\n", "de-en/train.tags.de-en.en": b"house .\n"}


def first_half(data):
    return data[:len(data) // 2]


@pytest.mark.parametrize("archive, says", [
    (first_half(gzip.compress(tar_of(TRAIN))), "cannot be extracted"),  # cut
    (gzip.compress(tar_of({**TRAIN, "de-en/../../evil": b"x"})), "holds an unsafe path "
     "'de-en/../../evil'"),
    (gzip.compress(tar_of({}, [("de-en/passwd", "/etc/passwd")])), "holds no train.tags"),
    (b"<html>not an archive</html>", "cannot be extracted"),
], ids=["cut", "a ../ member", "only an absolute link", "not an archive"])
def test_prepare_iwslt_on_a_refused_or_cut_archive_is_one_line(tmp_path, archive, says):
    (tmp_path / "de-en.tgz").write_bytes(archive)
    proc = subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.prepare_iwslt",
                           "--archive", tmp_path / "de-en.tgz", "--src", "de", "--tgt", "en",
                           "--out", tmp_path / "out"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    line = one_line(proc)
    assert line.startswith(f"error: {tmp_path / 'de-en.tgz'} ") and says in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ what the log says


def test_a_206_first_answer_with_an_etag_is_resumed(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, etag='"v1"', whole_as_206=True, cut=300_000)
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 0 and (tmp_path / "a.bin").read_bytes() == DATA
    assert requests_made(server) == [(None, None), ("bytes=300000-", '"v1"')]
    assert "no ETag" not in proc.stderr
    # the cut said in words, not as a nested tuple
    assert "cut after 300kB (Connection broken: IncompleteRead(" in proc.stderr, proc.stderr
    assert "((" not in proc.stderr


def test_the_last_line_of_progress_is_said_once(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA[:1000])  # one block: its update says 100 %
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 0
    assert len([line for line in proc.stderr.splitlines() if ": 100 % (" in line]) == 1


def test_a_retry_after_that_is_no_time_is_said_and_the_usual_wait_taken(server, tmp_path,
                                                                         capsys):
    server.routes["/a.bin"] = Route(data=DATA, busy=[(503, "soon")])
    out = fetch_mod.fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA, backoff=0)
    assert out.read_bytes() == DATA and len(server.log) == 2
    err = capsys.readouterr().err
    assert "the server's Retry-After 'soon' is neither" in err and "no answer" not in err
