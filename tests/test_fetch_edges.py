"""The downloader where a new user's network or input is unkind: a server without
validators, a proxy's short 206, a Hugging Face cache whose blobs link into the Xet store,
bad input ended in one line, a long Retry-After, and one connection pool per run; against
the loopback servers of tests/test_fetch.py."""

import errno
import hashlib
import json
import os
import re
import time
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from rdrop_fairseq.recipes.fetch import http as fetch_http
from rdrop_fairseq.recipes.fetch.__main__ import main as fetch_main
from tests.test_fetch import (DATA, REVISION, SHA, FullDisk, Route, a_new_run,  # noqa: F401
                              cli, hub, hub_entry, only, server, table_for)


# ------------------------------------------------------------------ no wrong file kept


def test_without_validators_or_a_checksum_a_cut_restarts_rather_than_splices(server, tmp_path):
    new = DATA[::-1]  # the host's file changes right after the cut; it sends no validator
    server.routes["/a.bin"] = Route(data=DATA, cut=120_000, then=Route(data=new))
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a.bin").read_bytes() == new  # not 120 kB of the old file in front
    assert [r["range"] for r in server.log] == [None, None]  # from zero, not resumed
    assert "no ETag or Last-Modified to resume 120kB against" in proc.stderr
    # a partial file an earlier run left, without a validator: started afresh too
    (tmp_path / "b.bin.partial").write_bytes(DATA[:5000])
    assert cli("--out", tmp_path / "b.bin", server.url("/a.bin")).returncode == 0
    assert (tmp_path / "b.bin").read_bytes() == new and server.log[-1]["range"] is None
    # with a checksum to check the result, the same cut resumes
    server.routes["/c.bin"] = Route(data=DATA, cut=120_000)
    proc = cli("--sha256", SHA, "--out", tmp_path / "c.bin", server.url("/c.bin"))
    assert proc.returncode == 0 and server.log[-1]["range"] == "bytes=120000-"


def test_a_short_206_is_a_cut_resumed_not_a_whole_file(server, tmp_path, capsys):
    # the resume's answer promises the rest (Content-Range) but brings 30 kB of it
    server.routes["/a.bin"] = Route(data=DATA, etag='"v1"', cut=100_000, short=30_000)
    out = fetch_mod.fetch([server.url("/a.bin")], tmp_path / "a.bin", backoff=0)
    assert out.read_bytes() == DATA and only(out) == ["a.bin"]
    assert [r["range"] for r in server.log] == [None, "bytes=100000-", "bytes=130000-"]
    assert f"cut at 130kB of {len(DATA) / 1e6:.2f}MB" in capsys.readouterr().err


def test_a_cached_hub_file_whose_blob_links_into_the_xet_store(server, hub, tmp_path,
                                                                 monkeypatch, capsys):
    """The cache as huggingface_hub 2.4 lays out a Xet-backed file: the snapshot's file links
    to ``blobs/<sha256>``, itself a link into the cache-wide store ``blobs/xx/<xet hash>``;
    laid out here by huggingface_hub's own functions."""
    shared = pytest.importorskip("huggingface_hub.utils._shared_blobs")
    from huggingface_hub import constants
    from huggingface_hub.file_download import _create_symlink

    cache, data = Path(constants.HF_HUB_CACHE), b"PAR1 a Xet-backed file PAR1"
    blob = cache / "models--org--model" / "blobs" / hashlib.sha256(data).hexdigest()
    xet = hashlib.sha256(b"another hash: Xet's, of the same file").hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    assert shared.publish_blob_to_shared_store(blob_path=str(blob), xet_hash=xet,
                                               cache_dir=cache, expected_size=len(data))
    pointer = cache / "models--org--model" / "snapshots" / REVISION / "data.parquet"
    pointer.parent.mkdir(parents=True)
    _create_symlink(str(blob), str(pointer), new_blob=False)
    assert blob.is_symlink() and os.path.realpath(pointer) == os.path.realpath(
        cache / "blobs" / xet[:2] / xet)
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"data": hub_entry(
        "data.parquet", no_public_record="a test")}))
    monkeypatch.setenv("OFFLINE", "1")
    out = fetch_mod.get("data", tmp_path / "dl", None, table)[0]
    assert out.read_bytes() == data and only(out) == ["data.parquet"] and server.log == []
    assert "data.parquet: sha256 verified as the hub publishes it" in capsys.readouterr().err


# ------------------------------------------------------------------ one line, never a traceback


def one_line(proc):
    """The error, which must be one line, and no traceback."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


URL = "http://127.0.0.1:9/x"


@pytest.mark.parametrize("args, message", [
    (["--timeout", "-1", "--out", "{tmp}/x", URL], "--timeout must be a number of seconds "
                                                   "above 0, not '-1'"),
    (["--timeout", "0", "--out", "{tmp}/x", URL], "above 0, not '0'"),  # was: silently 30 s
    (["--timeout", "soon", "--out", "{tmp}/x", URL], "above 0, not 'soon'"),
    (["--out", "{tmp}/x", "http://[::1"], "'http://[::1' is not a URL (Invalid IPv6 URL)"),
    (["--out", "{tmp}/x", "http://127.0.0.1:port/x"], "is not a URL (Port could not be"),
    # a folder that cannot be made: /proc takes no new folder, not even from root
    (["--out", "/proc/rdrop-test/x", URL], "cannot make the folder /proc/rdrop-test ("),
    (["--dir", "/proc/rdrop-test", "gpt2-bpe"], "cannot make the folder /proc/rdrop-test ("),
])
def test_bad_input_is_one_line_with_what_to_change(tmp_path, args, message):
    line = one_line(cli(*[a.format(tmp=tmp_path) for a in args], env={"RDROP_SOURCES": ""}))
    assert message in line and line.endswith("(--help: the options)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--out", "{dl}/a.bin", URL], ["--dir", "{dl}", "gpt2-bpe"]])
def test_a_folder_without_write_rights_is_one_line(tmp_path, monkeypatch, capsys, args):
    """The folder is there, but its lock file cannot be made: a folder of another user, as
    filelock meets it (the tests may run as root, whom no folder refuses)."""
    (tmp_path / "dl").mkdir()
    real_open = os.open

    def refused(path, flags, *rest, **kwargs):
        if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *rest, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    monkeypatch.delenv("RDROP_SOURCES", raising=False)
    with pytest.raises(SystemExit) as e:
        fetch_main([a.format(dl=tmp_path / "dl") for a in args])
    assert e.value.code == 2 and list((tmp_path / "dl").iterdir()) == []
    assert capsys.readouterr().err == (
        f"python -m rdrop_fairseq.recipes.fetch: error: cannot write {tmp_path / 'dl'} "
        "(Permission denied): give a place you can write to (--help: the options)\n")


@pytest.mark.parametrize("error, says", [
    (errno.EDQUOT, "the disk quota is exceeded: .*free space within your quota and run again"),
    (errno.EROFS, "the file system is read-only: .*make it writable and run again"),
])
def test_a_full_quota_or_a_read_only_file_system_keeps_the_partial_file(
        server, tmp_path, monkeypatch, error, says):
    server.routes["/a.bin"] = Route(data=DATA, etag='"v1"')
    disk = FullDisk(monkeypatch, fetch_http, 400_000, error)
    with pytest.raises(SystemExit) as e:
        fetch_main(["--sha256", SHA, "--out", str(tmp_path / "a.bin"), server.url("/a.bin")])
    assert "\n" not in str(e.value)
    assert re.search(f"^error: {says}: the download resumes", str(e.value))
    assert (tmp_path / "a.bin.partial").read_bytes() == DATA[:400_000]
    disk.room = None  # room again: the rerun resumes
    fetch_main(["--sha256", SHA, "--out", str(tmp_path / "a.bin"), server.url("/a.bin")])
    assert (tmp_path / "a.bin").read_bytes() == DATA and server.log[-1]["range"] == "bytes=400000-"


FILE = {"name": "a.bin", "urls": ["http://127.0.0.1:9/a.bin"], "sha256": SHA, "size": 1}


@pytest.mark.parametrize("table, message", [
    ([FILE], "the table must be a JSON object of sources by name, not ["),
    ({"x": "a.bin"}, "the table's x must be an object (files, make, ...), not \"a.bin\""),
    ({"x": {"files": FILE}}, "x's files must be a list of objects (name, urls, sha256, size)"),
    ({"x": {"files": []}}, "x needs files (or, where no host serves it, manual: what to do)"),
    ({"x": {"files": [dict(FILE, name=None)]}},
     "x's file's name must be the file's name, not null"),
    ({"x": {"files": [dict(FILE, urls=FILE["urls"][0])]}},
     "x's a.bin's urls must be a list of URLs"),
    ({"x": {"files": [dict(FILE, size="1 MB")]}}, "x's a.bin's size must be its number of bytes"),
    ({"x": {"files": [FILE], "hub": "org/model"}}, "x's hub must be an object with a repo and a"),
    ({"x": {"files": [FILE], "local": ["a", "b"]}}, "x's local must be text, not [\"a\", \"b\"]"),
    # a bad digest: found as the table is loaded, not blamed on --sha256
    ({"x": {"files": [dict(FILE, sha256="abc")]}},
     "x's a.bin's sha256 must hold 64 hex digits, not 'abc'"),
])
def test_a_malformed_table_is_one_line_naming_the_source_and_the_field(tmp_path, table, message):
    (tmp_path / "t.json").write_text(json.dumps(table))
    for args in (["--list"], ["--dir", tmp_path / "dl", "x"]):
        line = one_line(cli(*args, env={"RDROP_SOURCES": str(tmp_path / "t.json")}))
        assert line.startswith(f"error: {tmp_path / 't.json'}: ") and message in line, line
        assert "--sha256" not in line
    assert not (tmp_path / "dl").exists()


# ------------------------------------------------------------------ Retry-After


@pytest.mark.parametrize("after, env, says", [
    (3600, {}, "in 1.0 h"),  # the default cap, 120 s
    (4, {"RDROP_FETCH_MAX_RETRY_AFTER": "2"}, "in 4 s")])
def test_a_retry_after_above_the_cap_is_not_waited_for(server, tmp_path, after, env, says):
    server.routes["/a.bin"] = Route(data=DATA, busy=[(429, after)])
    start, cap = time.time(), env.get("RDROP_FETCH_MAX_RETRY_AFTER", "120")
    proc = cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin"), env=env)
    assert time.time() - start < 3 + 3  # the interpreter's start included
    assert proc.returncode != 0 and len(server.log) == 1
    at = {time.strftime("%Y-%m-%d %H:%M", time.gmtime(t + after)) for t in (start, time.time())}
    assert any(f"the server asks to be tried again {says}, at {when} UTC, later than "
               f"RDROP_FETCH_MAX_RETRY_AFTER ({cap} s) waits: run again then" in proc.stderr
               for when in at), proc.stderr
    assert only(tmp_path / "x") == []


def test_a_retry_after_below_the_cap_is_waited_for_and_said(server, tmp_path, capsys):
    server.routes["/a.bin"] = Route(data=DATA, busy=[(503, 4)])
    assert fetch_mod.fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA,
                           backoff=0).read_bytes() == DATA
    waited = server.log[1]["time"] - server.log[0]["time"]
    assert 3.9 <= waited < 6
    assert "waiting 4 s before trying again (the server's Retry-After)" in capsys.readouterr().err


def test_a_bad_cap_is_refused_before_anything_is_fetched(server, tmp_path):
    line = one_line(cli("--out", tmp_path / "a.bin", server.url("/a.bin"),
                        env={"RDROP_FETCH_MAX_RETRY_AFTER": "-5"}))
    assert "RDROP_FETCH_MAX_RETRY_AFTER must be a number of seconds above 0, not '-5'" in line
    assert server.log == []


# ------------------------------------------------------------------ one Session per run


def test_one_connection_pool_for_the_run_closed_at_its_end(server, tmp_path, monkeypatch):
    for name, data in (("a.bin", DATA), ("b.bin", DATA[::-1])):
        server.routes[f"/{name}"] = Route(data=data)
    table = table_for(server, tmp_path, {"two": {"files": [
        {"name": n, "urls": [server.url(f"/{n}")], "size": len(DATA),
         "sha256": hashlib.sha256(d).hexdigest()} for n, d in (("a.bin", DATA),
                                                               ("b.bin", DATA[::-1]))]}})
    monkeypatch.setenv("RDROP_SOURCES", str(table))
    fetch_main(["--dir", str(tmp_path / "dl"), "two"])
    assert [r["path"] for r in server.log] == ["/a.bin", "/b.bin"]
    ports = {r["port"] for r in server.log}
    assert len(ports) == 1  # both files over one connection
    deadline = time.monotonic() + 5
    while server.closed != list(ports):  # and the run closed it as it ended
        assert time.monotonic() < deadline, server.closed
        time.sleep(0.05)
