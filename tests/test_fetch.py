"""The recipes' downloader (rdrop_fairseq.recipes.fetch) against loopback HTTP(S) servers that
the tests start on 127.0.0.1: cuts resumed with Range and If-Range, mirrors after a 404, a
host that refuses Python's default User-Agent, wrong checksums and sizes, servers that
ignore Range, HTML pages served with 200, proxies, Ctrl-C, 429 with Retry-After, a slow
first byte over TLS, a redirect, name-lookup failures (a resolver stub), a full disk while
downloading and while unpacking, no network at all, and a stand-in of the Hugging Face hub."""

import errno
import gzip
import hashlib
import http.client
import http.server
import io
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from rdrop_fairseq.recipes.fetch import FetchError, core, fetch
from rdrop_fairseq.recipes.fetch import http as fetch_http
from rdrop_fairseq.recipes.fetch.__main__ import main as fetch_main
from tests.recipe_helpers import terminal_sigint

REPO = Path(__file__).resolve().parents[1]
DATA = bytes(range(256)) * 4096  # 1 MiB: the progress lines count tenths of it
SHA = hashlib.sha256(DATA).hexdigest()
NO_PROXY = {"http_proxy": "", "https_proxy": "", "HTTP_PROXY": "", "HTTPS_PROXY": "",
            "no_proxy": "*"}


class Route(dict):
    """How the server answers one path: ``data``; ``status`` (an error code instead);
    ``cut`` (bytes sent on the first request before the connection is dropped); ``ranges``
    (False: ignore Range); ``html`` (serve as text/html); ``refuse_python_ua``; ``stall``
    (bytes sent before the server waits); ``etag`` (sent, and an If-Range that differs
    gets the whole file); ``busy`` (a list of ``(status, Retry-After)`` answered first);
    ``redirect`` (a path it moved to); ``encoding`` (a Content-Encoding header); ``then``
    (the Route that answers from the next request on); ``short`` (bytes of the next 206
    sent, with a Content-Length that says so, and its Content-Range the whole rest: a
    proxy's cut); ``last_modified`` (sent, and an If-Range that differs from it and from the
    ETag gets the whole file); ``ignore_if_range`` (a Range is served whatever If-Range
    says); ``whole_as_206`` (a request without Range answered 206, bytes 0- of the file);
    ``gzip`` (the file gzipped on the way, whatever Accept-Encoding asked: Content-Encoding
    gzip, ranges counting gzipped bytes); ``type`` (the Content-Type)."""


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes, self.log, self.closed = {}, [], []  # closed: the clients' ports

    @property
    def base(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, path):
        return self.base + path


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def finish(self):  # the connection is over
        super().finish()
        self.server.closed.append(self.client_address[1])

    def do_GET(self):
        # a proxied request names the whole URL: serve it by its path too
        path = "/" + self.path.split("://", 1)[1].split("/", 1)[1] if "://" in self.path \
            else self.path
        route = self.server.routes.get(path)
        self.server.log.append({"path": path, "raw_path": self.path, "time": time.monotonic(),
                                "range": self.headers.get("Range"),
                                "if_range": self.headers.get("If-Range"),
                                "agent": self.headers.get("User-Agent"),
                                "port": self.client_address[1]})
        if route is None:
            return self._error(404)
        if route.get("refuse_python_ua") and "Python-urllib" in self.headers.get("User-Agent", ""):
            return self._error(403)
        if route.get("status"):
            return self._error(route["status"])
        if route.get("busy"):
            status, after = route["busy"].pop(0)
            return self._error(status, {"Retry-After": str(after)})
        if route.get("redirect"):
            return self._error(302, {"Location": route["redirect"]})
        data, start = route["data"], 0
        if route.get("gzip"):
            data = gzip.compress(data, mtime=0)
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        honoured = route.get("ignore_if_range") or if_range in (
            None, route.get("etag"), route.get("last_modified"))
        if rng and route.get("ranges", True) and honoured:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        elif route.get("whole_as_206"):
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", route.get("type") or (
            "text/html" if route.get("html") else "application/octet-stream"))
        if route.get("gzip"):
            self.send_header("Content-Encoding", "gzip")
        for header, key in (("ETag", "etag"), ("Content-Encoding", "encoding"),
                            ("Last-Modified", "last_modified")):
            if route.get(key):
                self.send_header(header, route[key])
        body = data[start:]
        if start and route.get("short"):
            body = body[:route.pop("short")]
        if route.get("no_length"):  # the body ends where the connection closes
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if route.get("then"):  # what the host serves from now on
            self.server.routes[path] = route.pop("then")
        cut = route.pop("cut", None)
        if cut is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        stall = route.get("stall")
        if stall is not None:
            self.wfile.write(body[:stall])
            self.wfile.flush()
            time.sleep(route.get("stall_s", 20))
            body = body[stall:]
        self.wfile.write(body)

    def _error(self, code, headers=()):
        body = f"<html><body>{code}</body></html>".encode()
        self.send_response(code)
        for header, value in dict(headers).items():
            self.send_header(header, value)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(autouse=True)
def a_new_run(monkeypatch):
    """Each test a run of its own: no earlier test's unreachable hosts or connections carry
    over."""
    monkeypatch.setattr(core, "_unreachable", {})
    yield
    fetch_http.close()


@pytest.fixture
def server(monkeypatch):
    for key, value in NO_PROXY.items():
        monkeypatch.setenv(key, value)
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def cli(*args, env=None, timeout=60):
    full_env = {**os.environ, **NO_PROXY, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rdrop_fairseq.recipes.fetch", *map(str, args)],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def only(path):
    """The names in ``path``'s folder, but for hidden ones (the lock files ``.NAME.lock``,
    which stay)."""
    return sorted(p.name for p in Path(path).parent.iterdir() if not p.name.startswith("."))


def test_a_cut_download_resumes_with_a_range_request(server, tmp_path, capsys):
    server.routes["/a.bin"] = Route(data=DATA, cut=300_000)
    out = fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA, backoff=0)
    assert out.read_bytes() == DATA
    assert [r["range"] for r in server.log] == [None, "bytes=300000-"]
    assert only(out) == ["a.bin"]  # no .partial, no record: the checksum is public
    err = capsys.readouterr().err
    assert "cut after 300kB" in err and "resuming at 300kB" in err
    # not a terminal: a line at every tenth or so, the last at 100 %
    assert "a.bin: 100 % (1.05MB of 1.05MB" in err and "left)" in err
    assert 5 <= len([line for line in err.splitlines() if " % (" in line]) <= 25


def test_a_404_mirror_then_a_good_one_and_every_url_named_on_failure(server, tmp_path):
    server.routes["/good.bin"] = Route(data=DATA)
    out = fetch([server.url("/gone.bin"), server.url("/good.bin")], tmp_path / "f.bin",
                sha256=SHA, backoff=0)
    assert out.read_bytes() == DATA
    assert [r["path"] for r in server.log] == ["/gone.bin", "/good.bin"]  # 404: no retry
    server.routes["/busy.bin"] = Route(status=503)
    with pytest.raises(FetchError) as e:
        fetch([server.url("/gone.bin"), server.url("/busy.bin")], tmp_path / "g.bin",
              sha256=SHA, backoff=0, retries=2)
    message = str(e.value)
    assert f"{server.url('/gone.bin')}: 404 Not Found" in message
    assert f"{server.url('/busy.bin')}: 503 Service Unavailable" in message
    assert "--sha256 " + SHA in message  # the command that fetches it by hand
    assert [r["path"] for r in server.log].count("/busy.bin") == 2  # 5xx: retried
    assert only(tmp_path / "g.bin") == ["f.bin"]


def test_a_host_that_refuses_pythons_user_agent(server, tmp_path):
    server.routes["/ua.bin"] = Route(data=DATA, refuse_python_ua=True)
    with pytest.raises(urllib.error.HTTPError) as e:  # the control: urllib's own agent
        urllib.request.urlopen(server.url("/ua.bin"), timeout=10)
    assert e.value.code == 403
    out = fetch([server.url("/ua.bin")], tmp_path / "ua.bin", sha256=SHA)
    assert out.read_bytes() == DATA and "rdrop-fairseq" in server.log[-1]["agent"]


def test_a_wrong_checksum_keeps_the_file_aside_and_never_resumes_from_it(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    wrong = "0" * 64
    for _ in range(2):
        proc = cli("--sha256", wrong, "--out", tmp_path / "a.bin", server.url("/a.bin"))
        assert proc.returncode != 0
        assert f"sha256 {SHA}, not {wrong}" in proc.stderr and "a.bin.bad" in proc.stderr
        assert only(tmp_path / "a.bin") == ["a.bin.bad"]  # nothing under the final name
        assert (tmp_path / "a.bin.bad").read_bytes() == DATA
    assert [r["range"] for r in server.log] == [None, None]  # the second run started afresh
    assert cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin")).returncode == 0
    assert (tmp_path / "a.bin").read_bytes() == DATA


def test_a_server_that_ignores_range_with_a_stale_partial(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, ranges=False)
    (tmp_path / "a.bin.partial").write_bytes(b"stale bytes of another file")
    out = fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA)
    assert server.log[0]["range"] == "bytes=27-"  # asked to resume, got the whole file
    assert out.read_bytes() == DATA and only(out) == ["a.bin"]


@pytest.mark.parametrize("route", [Route(data=b"<!DOCTYPE html><p>quota exceeded</p>", html=True),
                                   Route(data=b"\n <html><body>sign in</body></html>")])
def test_an_html_page_served_with_200_is_refused(server, tmp_path, route):
    server.routes["/model.tar.gz"] = route
    proc = cli("--out", tmp_path / "model.tar.gz", server.url("/model.tar.gz"))
    assert proc.returncode != 0 and "an HTML page" in proc.stderr
    assert only(tmp_path / "x") == []


def test_a_verified_file_is_not_fetched_again(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    for _ in range(2):
        assert cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin")).returncode == 0
    assert len(server.log) == 1
    (tmp_path / "a.bin").write_bytes(b"another file")
    proc = cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode != 0 and "it is another file" in proc.stderr
    assert (tmp_path / "a.bin").read_bytes() == b"another file"  # left as the user put it


def test_without_a_public_checksum_only_record_pins_the_first_download(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 0 and "first seen" not in proc.stderr
    assert only(tmp_path / "a.bin") == ["a.bin"]  # nothing pinned after the fact
    (tmp_path / "a.bin").unlink()
    proc = cli("--record", "--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode == 0 and f"first seen sha256 {SHA}" in proc.stderr
    assert (tmp_path / "a.bin.sha256").read_text().split()[0] == SHA
    (tmp_path / "a.bin").unlink()
    server.routes["/a.bin"] = Route(data=DATA[::-1])  # the host now serves something else
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode != 0 and f"not {SHA}" in proc.stderr
    assert not (tmp_path / "a.bin").exists()


def test_ctrl_c_keeps_the_partial_file_for_the_next_run(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, stall=200_000, stall_s=30)
    proc = subprocess.Popen([sys.executable, "-m", "rdrop_fairseq.recipes.fetch", "--sha256",
                             SHA, "--out", str(tmp_path / "a.bin"), server.url("/a.bin")],
                            env={**os.environ, **NO_PROXY, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, text=True, preexec_fn=terminal_sigint)
    partial = tmp_path / "a.bin.partial"
    deadline = time.monotonic() + 30
    while not (partial.exists() and partial.stat().st_size == 200_000):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=30)[1]
    assert proc.returncode != 0 and "run again to resume" in err
    assert partial.stat().st_size == 200_000
    server.routes["/a.bin"] = Route(data=DATA)
    assert cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin")).returncode == 0
    assert server.log[-1]["range"] == "bytes=200000-"
    assert (tmp_path / "a.bin").read_bytes() == DATA


class FullDisk:
    """Files opened for writing in ``module`` take ``room`` bytes in all, as a disk that
    fills: a short write first, then ENOSPC (or ``error``: EDQUOT, EROFS). ``room = None``:
    space freed."""

    def __init__(self, monkeypatch, module, room, error=errno.ENOSPC):
        self.room, real_open = room, open

        def full_open(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            if "b" not in mode or not set(mode) & set("wa"):
                return f
            real_write = f.write

            def write(data):
                if self.room is None:
                    return real_write(data)
                if self.room == 0:
                    raise OSError(error, os.strerror(error))
                n = real_write(bytes(memoryview(data)[:self.room]))
                self.room -= n
                return n  # short, as write() is on a disk that fills

            return type("Full", (), {"write": staticmethod(write), "__enter__": lambda s: s,
                                     "__exit__": lambda s, *e: f.close(),
                                     "__getattr__": lambda s, n: getattr(f, n)})()

        monkeypatch.setattr(module, "open", full_open, raising=False)


def test_a_full_disk_while_downloading_keeps_what_arrived_and_resumes(server, tmp_path,
                                                                      monkeypatch):
    server.routes["/a.bin"] = Route(data=DATA, etag='"v1"')
    disk = FullDisk(monkeypatch, fetch_http, 400_000)
    with pytest.raises(FetchError, match="the disk is full: .*a.bin.partial holds 400kB"):
        fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA)
    assert (tmp_path / "a.bin.partial").read_bytes() == DATA[:400_000]  # every byte written
    assert not (tmp_path / "a.bin").exists()
    disk.room = None  # space freed: the rerun resumes where the disk filled
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA
    assert [(r["range"], r["if_range"]) for r in server.log] == [
        (None, None), ("bytes=400000-", '"v1"')]


@pytest.mark.parametrize("route, sha, why", [
    # gzipped on the way: the server's ranges count gzipped bytes, the partial holds decoded
    (dict(gzip=True, etag='"v1"'), SHA, r"it came compressed \(Content-Encoding: gzip\)"),
    # nothing to resume against, nothing to check a spliced file with
    (dict(), None, "no ETag or Last-Modified and no checksum"),
])
def test_a_full_disk_where_a_rerun_cannot_resume_removes_the_partial_and_says_so(
        server, tmp_path, monkeypatch, route, sha, why):
    server.routes["/a.bin"] = Route(data=DATA, **route)
    disk = FullDisk(monkeypatch, fetch_http, 400_000)
    with pytest.raises(FetchError, match=rf"^the disk is full: a.bin cannot resume \({why}.*\), "
                                         r"so the 400kB that came are removed from "):
        fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=sha)
    assert not (tmp_path / "a.bin.partial").exists()  # the room the rerun needs
    assert not (tmp_path / "a.bin.partial.validator").exists()
    disk.room = None
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=sha).read_bytes() == DATA
    assert [r["range"] for r in server.log] == [None, None]  # afresh, as the line said


def test_a_full_disk_outside_the_download_is_one_line(server, tmp_path, monkeypatch, capsys):
    server.routes["/a.bin"] = Route(data=DATA)

    def full(out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out) + ".sha256")

    monkeypatch.setattr(core, "record_first_seen", full)  # --record's file, say
    with pytest.raises(SystemExit) as e:
        fetch_main(["--record", "--out", str(tmp_path / "a.bin"), server.url("/a.bin")])
    assert str(e.value) == f"error: the disk is full ({tmp_path / 'a.bin'}.sha256): free space " \
        "and run again"
    assert (tmp_path / "a.bin").read_bytes() == DATA  # the download itself is kept


def test_a_full_disk_while_unpacking_condemns_no_download(server, tmp_path, monkeypatch):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("top/model.pt", DATA)
    archive = buf.getvalue()
    server.routes["/m.zip"] = Route(data=archive)
    server.routes["/dict.txt"] = Route(data=b"a 1\n")
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"m": {"make": "unpack", "files": [
        {"name": "m.zip", "urls": [server.url("/m.zip")], "no_public_record": "a test"}]},
        "two": {"files": [
            {"name": "dict.txt", "urls": [server.url("/dict.txt")], "size": 4,
             "sha256": hashlib.sha256(b"a 1\n").hexdigest()},
            {"name": "w.bin", "urls": [server.url("/w.bin")], "size": len(DATA),
             "sha256": SHA}]}}))
    dl, dest = tmp_path / "dl", tmp_path / "work" / "m"
    real_copy = shutil.copyfileobj

    def copy_until_full(src, dst, length=0):  # unpacking fills the disk half way
        dst.write(src.read(300_000))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", copy_until_full)
    with pytest.raises(FetchError, match="the disk is full while making .*nothing is fetched"):
        fetch_mod.get("m", dl, dest, table)
    monkeypatch.setattr(shutil, "copyfileobj", real_copy)
    assert (dl / "m.zip").read_bytes() == archive and not dest.exists()
    assert only(dl / "x") == ["m.zip"] and not (tmp_path / "work").exists()
    # and while the second file of a source comes in: the first, whole, stays
    server.routes["/w.bin"] = Route(data=DATA)
    disk = FullDisk(monkeypatch, fetch_http, 500_004)  # dict.txt's 4 bytes, then w.bin's
    with pytest.raises(FetchError, match="the disk is full: .*w.bin.partial"):
        fetch_mod.get("two", dl, None, table)
    disk.room = None  # space freed
    assert fetch_mod.get("m", dl, dest, table) == dest and (dest / "model.pt").read_bytes() == DATA
    assert fetch_mod.get("two", dl, None, table) == [dl / "dict.txt", dl / "w.bin"]
    assert [(r["path"], r["range"]) for r in server.log] == [
        ("/m.zip", None), ("/dict.txt", None), ("/w.bin", None), ("/w.bin", "bytes=500000-")]


def test_the_proxy_variables_and_no_proxy_are_honoured(server, tmp_path, monkeypatch):
    server.routes["/p.bin"] = Route(data=DATA)
    monkeypatch.setenv("http_proxy", server.base)  # the loopback server proxies too
    monkeypatch.setenv("no_proxy", "")
    out = fetch(["http://rdrop-test.invalid/p.bin"], tmp_path / "p.bin", sha256=SHA)
    assert out.read_bytes() == DATA
    assert server.log[-1]["raw_path"] == "http://rdrop-test.invalid/p.bin"  # via the proxy
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # refuses every connection
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    out = fetch([server.url("/p.bin")], tmp_path / "direct.bin", sha256=SHA)
    assert out.read_bytes() == DATA and server.log[-1]["raw_path"] == "/p.bin"


@pytest.mark.parametrize("env, url", [
    ({"http_proxy": "http://127.0.0.1:9", "no_proxy": ""}, "http://rdrop-test.invalid/x"),
    ({}, "http://127.0.0.1:9/x.tgz"),  # connection refused
    ({}, "http://rdrop-test.invalid/x.tgz"),  # no such host
])
def test_no_connection_gives_up_within_seconds_and_leaves_nothing(tmp_path, env, url):
    start = time.monotonic()
    proc = cli("--out", tmp_path / "sub" / "x.tgz", url, url, env=env)
    assert time.monotonic() - start < 5 + 3  # the interpreter's start included
    assert proc.returncode != 0 and "no connection" in proc.stderr
    # the message OFFLINE=1 gives: what is missing, where it comes from, how by hand
    assert f"{tmp_path / 'sub' / 'x.tgz'} is missing: it comes from {url} or {url}" in proc.stderr
    assert "fetch it by hand" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error")]) == 1
    assert list(tmp_path.iterdir()) == []  # not even the folder


@pytest.mark.parametrize("args, message", [
    (["--out", "{tmp}/x", "ftp://example.org/x"], "is not an http(s) URL"),
    (["--out", "{tmp}", "http://127.0.0.1:9/x"], "is a folder"),
    (["--sha256", "abc", "--out", "{tmp}/x", "http://127.0.0.1:9/x"], "64 hex digits"),
    (["http://127.0.0.1:9/x"], "give --out FILE with URLs"),
    (["--out", "{tmp}/x", "http:///x"], "is not an http(s) URL"),
    (["--out", "{tmp}/file/x", "http://127.0.0.1:9/x"], "file is a file, not a folder"),
    (["--dir", "{tmp}/file", "gpt2-bpe"], "file is a file, not a folder"),
])
def test_bad_input_is_refused_before_anything_is_fetched(tmp_path, args, message):
    (tmp_path / "file").write_text("a file where a folder would go")
    proc = cli(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


# ------------------------------------------------------------------ the source table


def table_for(server, tmp_path, entries, name="sources.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entries))
    return path


def test_named_sources_offline_and_dry_run(server, tmp_path):
    server.routes["/w.zip"] = Route(data=DATA)
    table = table_for(server, tmp_path, {
        "corpus": {"files": [{"name": "w.zip", "urls": [server.url("/w.zip")], "sha256": SHA,
                              "size": len(DATA)}],
                   "local": "set SOURCE to a local w.zip"},
        "other": {"files": [{"name": "o.bin", "urls": [server.url("/o.bin")],
                             "no_public_record": "a test"}]},
        "gone": {"files": [], "manual": "no host serves it; set X to your copy"}})
    env = {"RDROP_SOURCES": str(table)}
    dl = tmp_path / "dl"
    unpinned = table_for(server, tmp_path, {"x": {"files": [{"name": "o.bin", "urls": [
        server.url("/o.bin")], "sha256": SHA}]}}, "unpinned.json")
    proc = cli("--dir", dl, "x", env={"RDROP_SOURCES": str(unpinned)})
    assert proc.returncode != 0 and "x's o.bin is not pinned: give its sha256" in proc.stderr
    branch = {"hub": {"repo": "org/m", "revision": "main"},
              "files": [{"name": "h.bin", "path": "h.bin", "sha256": SHA, "size": 1}]}
    on_a_branch = table_for(server, tmp_path, {"h": branch}, "branch.json")
    proc = cli("--dir", dl, "h", env={"RDROP_SOURCES": str(on_a_branch)})
    assert proc.returncode != 0 and "h's hub revision is 'main': give the commit id" in proc.stderr
    for spec in ({"urls": [server.url("/o.bin")]},  # a hub file is fetched from its hub
                 {"path": "h.bin", "urls": [server.url("/o.bin")]}):
        entry = {"hub": {"repo": "org/m", "revision": "0" * 40},
                 "files": [{"name": "h.bin", "sha256": SHA, "size": 1, **spec}]}
        with_urls = table_for(server, tmp_path, {"h": entry}, "urls.json")
        proc = cli("--dir", dl, "h", env={"RDROP_SOURCES": str(with_urls)})
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "h's h.bin is on its hub: give its path in the repository, not urls" in proc.stderr
    proc = cli("--dir", dl, "corpus", "other", env={**env, "OFFLINE": "1"})
    assert proc.returncode != 0 and server.log == [] and not dl.exists()
    for name in ("w.zip", "o.bin"):  # every missing file, where from, how by hand
        assert f"{dl / name} is missing: it comes from {server.url('/' + name[0] + name[1:])}" \
            in proc.stderr
    assert f"--sha256 {SHA} --out {dl / 'w.zip'}" in proc.stderr
    assert "set SOURCE to a local w.zip" in proc.stderr
    proc = cli("--dir", dl, "corpus", "gone", env={**env, "DRY_RUN": "1"})
    assert proc.returncode == 0 and server.log == [] and not dl.exists()
    assert f"++ fetch {server.url('/w.zip')} -> {dl / 'w.zip'}" in proc.stdout
    assert "no host serves it" in proc.stdout
    proc = cli("--dir", dl, "gone", env=env)
    assert proc.returncode != 0 and "no live source" in proc.stderr
    assert cli("--dir", dl, "corpus", env=env).returncode == 0
    assert (dl / "w.zip").read_bytes() == DATA


def test_every_file_of_the_packaged_table_is_pinned():
    table = fetch_mod.load_sources(fetch_mod.TABLE)
    for name, entry in table.items():
        assert entry.get("licence") and entry.get("used_by"), name
        if entry.get("manual"):
            continue
        assert entry["files"] and entry.get("local"), name
        for spec in entry["files"]:
            check = fetch_mod.verify.checksum_of(spec)
            # a digest and a size from a public record, or the field that says none exists
            assert (check and spec.get("size")) or spec.get("no_public_record"), spec["name"]
            if check:
                assert fetch_mod.check_digest(*check) and entry.get("checksum_from"), name
            if entry.get("hub"):
                assert spec["path"] and entry["hub"]["revision_from"], name
            else:
                assert all(u.startswith(("https://", "http://")) for u in spec["urls"])
        make = entry.get("make", "copy")
        assert make in ("copy", "unpack") or callable(fetch_mod.table._maker(make)), name
    for name in ["wikitext-103", "iwslt14-de-en", "iwslt17-en-zh", "wmt13-europarl-v7",
                 "glue-RTE", "glue-MRPC", "glue-QQP", "gpt2-bpe", "roberta.base",
                 "roberta.large", "bart.large", "cnn_dailymail", "bert-base-uncased"]:
        assert name in table
    wikitext = table["wikitext-103"]["files"][0]
    assert (wikitext["sha256"], wikitext["size"]) == (
        "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590", 190_229_076)
    assert table["wmt14-test-full"]["files"][0]["md5"] == "a8cd784e006feb32ac6f3d9ec7eb389a"
    assert table["glue-QQP"]["files"][0]["size"] == 41_696_084
    for hubbed in ["bert-base-uncased", "cnn_dailymail", "iwslt17-en-zh"]:
        revision = table[hubbed]["hub"]["revision"]
        assert len(revision) == 40 and set(revision) <= set("0123456789abcdef")  # a commit
    cnndm = {f["path"]: f for f in table["cnn_dailymail"]["files"]}
    assert (cnndm["3.0.0/test-00000-of-00001.parquet"]["sha256"][:12],
            cnndm["3.0.0/test-00000-of-00001.parquet"]["size"]) == ("04e322d2634a", 30_000_471)
    for manual in ["iwslt14-en-fr", "iwslt14-en-es", "wmt16-google-en-de"]:
        assert table[manual]["manual"]
    for module in (REPO / "rdrop_fairseq/recipes/fetch").glob("*.py"):
        assert "import prepare" not in module.read_text(), module


def test_a_corrupt_archive_without_a_checksum_names_the_file_and_its_source(server, tmp_path):
    server.routes["/model.tar.gz"] = Route(data=b"\x1f\x8b" + DATA[:5000])  # not a tarball
    table = table_for(server, tmp_path, {"model": {
        "files": [{"name": "model.tar.gz", "urls": [server.url("/model.tar.gz")],
                   "no_public_record": "a test"}], "make": "unpack"}})
    dest = tmp_path / "work" / "model"
    proc = cli("--dir", tmp_path / "dl", f"model={dest}", env={"RDROP_SOURCES": str(table)})
    assert proc.returncode != 0
    assert f"{server.url('/model.tar.gz')}: a corrupt archive (" in proc.stderr
    assert f"kept as {tmp_path / 'dl' / 'model.tar.gz.bad'}" in proc.stderr
    assert not (tmp_path / "work").exists()  # no DEST, no half-made sibling, no empty parent


def test_a_corrupt_archive_is_not_pinned_by_record(server, tmp_path):
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w:gz") as tar:
        info = tarfile.TarInfo("model/model.pt")
        info.size = len(DATA)
        tar.addfile(info, io.BytesIO(DATA))
    good = good.getvalue()
    corrupt = good[:-8] + bytes(8)  # the gzip trailer's CRC: tarfile alone never reads it
    server.routes["/model.tar.gz"] = Route(data=corrupt)
    table = table_for(server, tmp_path, {"model": {
        "files": [{"name": "model.tar.gz", "urls": [server.url("/model.tar.gz")],
                   "no_public_record": "a test"}], "make": "unpack"}})
    dl, dest = tmp_path / "dl", tmp_path / "work" / "model"
    env = {"RDROP_SOURCES": str(table)}
    proc = cli("--record", "--dir", dl, f"model={dest}", env=env)
    assert proc.returncode != 0 and "a corrupt archive (CRC check failed" in proc.stderr
    assert only(dl / "x") == ["model.tar.gz.bad"]  # no record
    server.routes["/model.tar.gz"] = Route(data=good)
    proc = cli("--record", "--dir", dl, f"model={dest}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "model.pt").read_bytes() == DATA
    assert only(dl / "x") == ["model.tar.gz", "model.tar.gz.sha256"]
    assert (dl / "model.tar.gz.sha256").read_text().split()[0] == hashlib.sha256(good).hexdigest()


def test_a_body_without_a_length_needs_a_checksum(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, no_length=True)
    with pytest.raises(FetchError, match="no Content-Length, and no checksum"):
        fetch([server.url("/a.bin")], tmp_path / "a.bin", backoff=0)
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA


def test_two_runs_fetching_one_file_take_turns(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, stall=100_000, stall_s=1)
    env = {**os.environ, **NO_PROXY, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "rdrop_fairseq.recipes.fetch", "--record",
                               "--out", str(tmp_path / "a.bin"), server.url("/a.bin")], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert (tmp_path / "a.bin").read_bytes() == DATA and len(server.log) == 1
    assert any("waiting for another run" in e for e in errs)
    assert (tmp_path / "a.bin.sha256").read_text().split()[0] == SHA


def test_a_complete_partial_answered_416_is_not_fetched_again(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    (tmp_path / "a.bin.partial").write_bytes(DATA)  # a run killed while hashing it
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA
    assert [r["range"] for r in server.log] == [f"bytes={len(DATA)}-"]


def test_a_host_that_drops_packets_is_tried_with_the_per_try_connect_timeout(tmp_path,
                                                                           monkeypatch):
    import urllib3.util.connection

    tries = []

    def black_hole(address, timeout=None, *args, **kwargs):
        tries.append((address, timeout))
        time.sleep(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(urllib3.util.connection, "create_connection", black_hole)
    monkeypatch.setenv("RDROP_FETCH_CONNECT_TIMEOUT", "0.3")
    start = time.monotonic()
    with pytest.raises(fetch_mod.NoNetwork) as e:
        fetch(["http://10.255.255.1/a.bin", "http://10.255.255.2/a.bin"], tmp_path / "a.bin",
              sha256=SHA, backoff=0)
    assert time.monotonic() - start < 4  # 2 URLs x 3 tries x 0.3 s, not 30 s each
    assert [t for _, t in tries] == [0.3] * 6  # each try its own connect time-out
    assert [a[0] for a, _ in tries] == ["10.255.255.1"] * 3 + ["10.255.255.2"] * 3
    assert "no connection (within 0.3 s)" in str(e.value)
    assert "is missing: it comes from" in str(e.value) and only(tmp_path / "x") == []
    monkeypatch.setenv("RDROP_FETCH_CONNECT_TIMEOUT", "soon")
    with pytest.raises(fetch_mod.BadInput, match="RDROP_FETCH_CONNECT_TIMEOUT must be a"):
        fetch(["http://10.255.255.1/a.bin"], tmp_path / "a.bin", sha256=SHA)


def test_files_that_cannot_be_made_into_dest_are_one_line_and_kept(server, tmp_path):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    server.routes["/train.txt"] = Route(data=(header + "1\t1\t2\ta b\tc d\n").encode())
    server.routes["/test.txt"] = Route(data=(header + "1\t3\t4\te f\tg h\n").encode())
    server.routes["/ids.tsv"] = Route(data=b"8\t9\n")  # a pair the training file lacks
    table = table_for(server, tmp_path, {"glue-MRPC": {
        "make": "rdrop_fairseq.recipes.prepare_glue:mrpc_from_downloads", "files": [
            {"name": n, "urls": [server.url("/" + n)], "no_public_record": "a test"}
            for n in ("train.txt", "test.txt", "ids.tsv")]}})
    for _ in range(2):
        proc = cli("--dir", tmp_path / "dl", f"glue-MRPC={tmp_path / 'work' / 'MRPC'}",
                   env={"RDROP_SOURCES": str(table)})
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "cannot be made into" in proc.stderr and "ids.tsv lists 1 pairs" in proc.stderr
        # the making failed, not the downloads: kept, and not fetched again
        assert only(tmp_path / "dl" / "x") == ["ids.tsv", "test.txt", "train.txt"]
        assert not (tmp_path / "work").exists()
    assert len(server.log) == 3


# ------------------------------------------------------------------ slow and flaky links


def test_a_file_changed_between_a_cut_and_the_resume_is_fetched_afresh(server, tmp_path):
    new = DATA[::-1]  # the host's file changes right after the cut
    server.routes["/a.bin"] = Route(data=DATA, etag='"v1"', cut=300_000,
                                    then=Route(data=new, etag='"v2"'))
    out = fetch([server.url("/a.bin")], tmp_path / "a.bin",
                sha256=hashlib.sha256(new).hexdigest(), backoff=0)
    assert out.read_bytes() == new  # the new file whole: no old head spliced on
    assert [(r["range"], r["if_range"]) for r in server.log] == [
        (None, None), ("bytes=300000-", '"v1"')]
    assert only(out) == ["a.bin"]  # no partial, no validator left


def test_a_429_with_retry_after_is_waited_for(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, busy=[(429, 2)])
    start = time.monotonic()
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA
    waited = server.log[1]["time"] - server.log[0]["time"]
    assert 1.8 <= waited < 4 and time.monotonic() - start < 6  # the 2 s it asked for


def test_wrong_size_or_digest_leaves_nothing_under_the_final_name(server, tmp_path):
    # without a Content-Length, a wrong size shows once the file is in (one that a
    # Content-Length announces is refused before the body: tests/test_fetch_lies.py)
    server.routes["/a.bin"] = Route(data=DATA, no_length=True)
    for kwargs, why in [({"size": len(DATA) + 1, "sha256": SHA}, f"{len(DATA)} bytes, not"),
                        ({"size": len(DATA), "sha256": "1" * 64}, "the wrong checksum")]:
        with pytest.raises(FetchError, match=why):
            fetch([server.url("/a.bin")], tmp_path / "a.bin", **kwargs)
        assert only(tmp_path / "a.bin") == ["a.bin.bad"]


def test_a_tar_gz_served_with_content_encoding_gzip_stays_as_served(server, tmp_path):
    body = gzip.compress(b"a tarball's bytes" * 1000)
    server.routes["/m.tar.gz"] = Route(data=body, encoding="gzip")
    out = fetch([server.url("/m.tar.gz")], tmp_path / "m.tar.gz",
                sha256=hashlib.sha256(body).hexdigest())
    assert out.read_bytes() == body


@pytest.fixture
def resolver(monkeypatch, server):
    """A stub of the name look-up: ``answers[host]`` lists what each look-up of it gives
    (an errno for a failure; the last answer repeats); ``looked_up`` counts them."""
    real = socket.getaddrinfo
    stub = type("Resolver", (), {})()
    stub.answers, stub.looked_up = {}, []

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in stub.answers:
            return real(host, port, *args, **kwargs)
        stub.looked_up.append(host)
        answers = stub.answers[host]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer == "ok":
            return real("127.0.0.1", port, *args, **kwargs)
        raise socket.gaierror(answer, os.strerror(answer) if answer > 0 else "lookup failed")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return stub


def test_a_temporary_name_lookup_failure_is_tried_again(server, tmp_path, resolver):
    server.routes["/a.bin"] = Route(data=DATA)
    resolver.answers["flaky.test"] = [socket.EAI_AGAIN, "ok"]
    url = f"http://flaky.test:{server.server_address[1]}/a.bin"
    assert fetch([url], tmp_path / "a.bin", sha256=SHA, backoff=0).read_bytes() == DATA
    assert resolver.looked_up == ["flaky.test", "flaky.test"]


@pytest.mark.parametrize("failure, tries", [
    (socket.EAI_NONAME, ["gone.test", "gone2.test"]),  # no such name: once each
    # a look-up that keeps failing "temporarily" (a machine whose resolver is unreachable):
    # three tries for the first host, then one for the other
    (socket.EAI_AGAIN, ["gone.test"] * 3 + ["gone2.test"]),
])
def test_names_that_never_resolve_give_the_offline_message_within_seconds(
        server, tmp_path, resolver, failure, tries):
    resolver.answers["gone.test"] = resolver.answers["gone2.test"] = [failure]
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"corpus": {"files": [
        {"name": n, "urls": [f"https://gone.test/{n}", f"http://gone2.test/{n}"],
         "sha256": SHA, "size": len(DATA)} for n in ("a.zip", "b.zip")],
        "local": "set SOURCE to your copy"}}))
    start = time.monotonic()
    with pytest.raises(fetch_mod.NoNetwork) as e:
        fetch_mod.get("corpus", tmp_path / "dl", None, table)
    assert time.monotonic() - start < 5
    assert resolver.looked_up == tries  # b.zip is not tried: no network was found
    message = str(e.value)
    for n in ("a.zip", "b.zip"):  # as OFFLINE=1 says it: each file, where from, by hand
        assert f"{tmp_path / 'dl' / n} is missing: it comes from https://gone.test/{n}" in message
        assert f"--sha256 {SHA} --out {tmp_path / 'dl' / n}" in message
    assert "no connection" in message and message.endswith("| or set SOURCE to your copy")
    assert not (tmp_path / "dl").exists()


def test_an_unreachable_host_does_not_make_the_other_hosts_offline(server, tmp_path,
                                                                    resolver):
    # a firewall that blocks one host (the hub, say) while another host still answers
    resolver.answers["blocked.test"] = [socket.EAI_NONAME]
    server.routes["/a.bin"] = Route(data=DATA)
    with pytest.raises(fetch_mod.NoNetwork):
        fetch(["https://blocked.test/x.bin"], tmp_path / "x.bin", sha256=SHA)
    with pytest.raises(fetch_mod.NoNetwork, match="no network \\(https://blocked.test/x.bin"):
        fetch(["https://blocked.test/y.bin"], tmp_path / "y.bin", sha256=SHA)
    assert resolver.looked_up == ["blocked.test"]  # known unreachable: not waited for again
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA


def test_a_mirror_out_of_reach_is_not_waited_for_again(server, tmp_path, resolver):
    resolver.answers["dead.test"] = [socket.EAI_AGAIN]  # three tries, the first time only
    server.routes["/a.bin"] = Route(data=DATA)
    for name in ("a.bin", "b.bin"):
        out = fetch(["http://dead.test/a.bin", server.url("/a.bin")], tmp_path / name,
                    sha256=SHA, backoff=0)
        assert out.read_bytes() == DATA
    assert resolver.looked_up == ["dead.test"] * 3


# ------------------------------------------------------------------ HTTPS


@pytest.fixture
def tls_server(server, tmp_path_factory, monkeypatch):
    """The loopback server behind TLS, with a certificate made here (openssl) that the
    downloads trust through REQUESTS_CA_BUNDLE; ``server.delay``: seconds before the
    server's first byte (its TLS handshake)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    srv = Server()
    srv.routes, srv.log, srv.delay = server.routes, server.log, 0
    get_request = srv.get_request

    def tls_request():
        sock, address = get_request()
        return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    srv.get_request = tls_request
    handle = Handler.setup

    def setup(self):
        time.sleep(self.server.delay)
        self.request.do_handshake()
        handle(self)

    monkeypatch.setattr(Handler, "setup", setup)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(folder / "cert.pem"))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.https = lambda path: f"https://127.0.0.1:{srv.server_address[1]}{path}"
    yield srv
    srv.shutdown()
    srv.server_close()


def test_https_with_a_redirect_to_another_path(tls_server, tmp_path):
    tls_server.routes["/old/a.bin"] = Route(redirect="/new/a.bin")
    tls_server.routes["/new/a.bin"] = Route(data=DATA, cut=500_000)
    out = fetch([tls_server.https("/old/a.bin")], tmp_path / "a.bin", sha256=SHA, backoff=0)
    assert out.read_bytes() == DATA
    assert [(r["path"], r["range"]) for r in tls_server.log] == [
        ("/old/a.bin", None), ("/new/a.bin", None), ("/old/a.bin", "bytes=500000-"),
        ("/new/a.bin", "bytes=500000-")]


def test_a_first_byte_8_s_late_still_completes(tls_server, tmp_path):
    """A slow link: the server's first byte (its TLS handshake) comes 8 s late."""
    tls_server.routes["/a.bin"] = Route(data=DATA)
    tls_server.delay = 8
    start = time.monotonic()
    assert fetch([tls_server.https("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() \
        == DATA
    assert 8 <= time.monotonic() - start < 20 and len(tls_server.log) == 1


# ------------------------------------------------------------------ the Hugging Face hub


REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(server, monkeypatch, tmp_path):
    """A stand-in of the Hugging Face hub on the loopback server (HF_ENDPOINT), answering as
    the hub answers for a file in git LFS: ``/org/model/resolve/REVISION/NAME`` redirects
    (302) to the file's storage, ``/cdn/NAME`` (a Route: Range, If-Range), with the file's
    SHA-256 in X-Linked-Etag; ``/old/model/...`` redirects (307) to ``/org/model/...`` (a
    renamed repository). ``hub[NAME] = bytes`` adds a file; ``hub.etags[NAME]``: another
    SHA-256 to publish than the file's own (a file that arrives corrupt);
    ``hub.locations[NAME]``: another storage URL. An empty Hugging Face cache
    (HF_HUB_CACHE) of the test's own."""
    files = type("Files", (dict,), {"__setitem__": lambda self, name, data: (
        dict.__setitem__(self, name, data), server.routes.__setitem__(
            f"/cdn/{name}", Route(data=data, etag=f'"cdn-{len(data)}"')))})()
    files.etags, files.locations = {}, {}

    class HubHandler(Handler):
        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            prefix = f"/org/model/resolve/{REVISION}/"
            if not self.path.startswith(("/org/", "/old/")):
                return super().do_GET()
            self.server.log.append({"path": self.path, "method": self.command,
                                    "range": self.headers.get("Range"),
                                    "if_range": self.headers.get("If-Range")})
            if self.path.startswith("/old/"):
                return self._error(307, {"Location": "/org/" + self.path[len("/old/"):]})
            name = self.path[len(prefix):] if self.path.startswith(prefix) else None
            if name not in files:
                return self._error(404, {"X-Error-Code": "EntryNotFound"})
            sha = files.etags.get(name, hashlib.sha256(files[name]).hexdigest())
            self._error(302, {"Location": files.locations.get(name, f"/cdn/{name}"),
                              "X-Repo-Commit": REVISION,
                              "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(files[name]),
                              "ETag": '"' + "1" * 40 + '"'})  # the pointer's git blob id

    server.RequestHandlerClass = HubHandler
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return files


def hub_entry(*names, **spec):
    return {"hub": {"repo": "org/model", "revision": REVISION, "revision_from": "a test"},
            "files": [{"name": n, "path": n, **spec} for n in names], "make": "copy",
            "local": "set MODEL_DIR"}


def test_hub_files_come_from_the_hub_at_the_pinned_commit(server, hub, tmp_path):
    hub["config.json"], hub["model.safetensors"] = b'{"a": 1}', DATA
    entry = hub_entry()
    entry["files"] = [{"name": f"model/{n}", "path": n, "size": len(d),
                       "sha256": hashlib.sha256(d).hexdigest()} for n, d in hub.items()]
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"model": entry}))
    dl, dest = tmp_path / "dl", tmp_path / "work" / "model"
    assert fetch_mod.get("model", dl, dest, table) == dest
    assert (dest / "model.safetensors").read_bytes() == DATA
    assert (dl / "model" / "config.json").read_bytes() == b'{"a": 1}'
    assert [r["path"] for r in server.log] == [
        p for n in hub for p in (f"/org/model/resolve/{REVISION}/{n}", f"/cdn/{n}")]
    assert "rdrop-fairseq" in server.log[-1]["agent"]  # the redirect keeps our User-Agent
    served = len(server.log)
    shutil.rmtree(dest)
    assert fetch_mod.get("model", dl, dest, table) == dest and len(server.log) == served
    # a file the hub serves that is not the pinned one: refused, kept aside
    entry["files"] = [{"name": "other/config.json", "path": "config.json", "size": 8,
                       "sha256": "0" * 64}]
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"model": entry}))
    with pytest.raises(FetchError, match="the wrong checksum"):
        fetch_mod.get("model", dl, None, table)
    assert only(dl / "other" / "x") == ["config.json.bad"]


def test_hub_files_without_a_public_record_are_checked_against_the_hubs_sha256(
        server, hub, tmp_path, capsys):
    hub["a.parquet"] = hub["b.parquet"] = b"PAR1" + DATA + b"PAR1"
    hub.etags["b.parquet"] = "0" * 64  # the hub's record of b is not what arrives
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"data": hub_entry(
        "a.parquet", "b.parquet", no_public_record="a test")}))
    with pytest.raises(FetchError, match=f"the wrong checksum \\(sha256 \\w+, not {'0' * 64}"):
        fetch_mod.get("data", tmp_path / "dl", None, table)
    assert (tmp_path / "dl" / "a.parquet").read_bytes() == hub["a.parquet"]
    assert only(tmp_path / "dl" / "x") == ["a.parquet", "b.parquet.bad"]
    err = capsys.readouterr().err
    assert f"a.parquet: sha256 verified as the hub publishes it at revision {REVISION[:12]}" in err
    assert "b.parquet: sha256 verified" not in err


def test_a_hub_file_resumes_where_an_earlier_run_stopped(server, hub, tmp_path):
    hub["model.safetensors"] = DATA
    dl = tmp_path / "dl"
    dl.mkdir()
    # what a run stopped by Ctrl-C, a full disk or a lost link leaves behind
    (dl / "model.safetensors.partial").write_bytes(DATA[:300_000])
    # a validator from another storage node: not sent (the file at a commit cannot change)
    (dl / "model.safetensors.partial.validator").write_text('"another-node"')
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"model": hub_entry(
        "model.safetensors", sha256=SHA, size=len(DATA))}))
    assert fetch_mod.get("model", dl, None, table)[0].read_bytes() == DATA
    assert [(r["path"], r["range"], r["if_range"]) for r in server.log] == [
        (f"/org/model/resolve/{REVISION}/model.safetensors", "bytes=300000-", None),
        ("/cdn/model.safetensors", "bytes=300000-", None)]
    assert only(dl / "x") == ["model.safetensors"]


def test_a_hub_file_in_the_hugging_face_cache_is_used_without_the_network(
        server, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    snapshot = Path(hub_constants.HF_HUB_CACHE) / "models--org--model" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes(b'{"a": 1}')
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"model": hub_entry(
        "config.json", sha256=hashlib.sha256(b'{"a": 1}').hexdigest(), size=8)}))
    for variable in ("HF_HUB_OFFLINE", "OFFLINE"):
        monkeypatch.setenv(variable, "1")
        out = fetch_mod.get("model", tmp_path / variable, None, table)[0]
        assert out.read_bytes() == b'{"a": 1}' and server.log == []
    (snapshot / "config.json").write_bytes(b'{"a": 2}')  # a cache that holds another file
    with pytest.raises(FetchError, match="the wrong checksum"):
        fetch_mod.get("model", tmp_path / "other", None, table)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("OFFLINE")
    hub["config.json"] = b'{"a": 1}'  # online, a bad cached copy gives way to the hub's
    out = fetch_mod.get("model", tmp_path / "online", None, table)[0]
    assert out.read_bytes() == b'{"a": 1}' and len(server.log) == 2


def test_a_cached_hub_file_without_a_public_record_is_checked_by_its_blob(
        server, hub, tmp_path):
    import huggingface_hub.constants as hub_constants

    repo = Path(hub_constants.HF_HUB_CACHE) / "models--org--model"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data, blob in [("good.parquet", b"PAR1 a PAR1", None),
                             ("bad.parquet", b"PAR1 junk PAR1", "0" * 64)]:
        blob = repo / "blobs" / (blob or hashlib.sha256(data).hexdigest())  # as the hub's
        blob.write_bytes(data)
        (repo / "snapshots" / REVISION / name).symlink_to(blob)
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"data": hub_entry(
        "good.parquet", "bad.parquet", no_public_record="a test")}))
    os.environ["OFFLINE"] = "1"
    try:
        with pytest.raises(FetchError, match=f"the wrong checksum .*not {'0' * 64}"):
            fetch_mod.get("data", tmp_path / "dl", None, table)
    finally:
        del os.environ["OFFLINE"]
    assert (tmp_path / "dl" / "good.parquet").read_bytes() == b"PAR1 a PAR1"
    assert only(tmp_path / "dl" / "x") == ["bad.parquet.bad", "good.parquet"]


def test_the_hubs_sha256_is_read_through_a_renamed_repositorys_redirect(server, hub, tmp_path):
    hub["a.parquet"] = b"PAR1" + DATA + b"PAR1"
    hub.etags["a.parquet"] = "0" * 64
    entry = hub_entry("a.parquet", no_public_record="a test")
    entry["hub"]["repo"] = "old/model"  # 307 to org/model, then 302 to the storage
    table = fetch_mod.load_sources(table_for(server, tmp_path, {"data": entry}))
    with pytest.raises(FetchError, match=f"the wrong checksum .*not {'0' * 64}"):
        fetch_mod.get("data", tmp_path / "dl", None, table)
    assert [r["path"].split("/")[1] for r in server.log] == ["old", "org", "cdn"]


def test_a_storage_host_out_of_reach_does_not_make_the_hub_out_of_reach(server, hub, tmp_path):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    hub["big.bin"], hub["small.json"] = DATA, b"{}"
    hub.locations["big.bin"] = f"http://127.0.0.1:{port}/big.bin"
    table = fetch_mod.load_sources(table_for(server, tmp_path, {
        "big": hub_entry("big.bin", sha256=SHA, size=len(DATA)),
        "small": hub_entry("small.json", sha256=hashlib.sha256(b"{}").hexdigest(), size=2)}))
    with pytest.raises(fetch_mod.NoNetwork):
        fetch_mod.get("big", tmp_path / "dl", None, table, )
    assert set(core._unreachable) == {f"127.0.0.1:{port}"}  # the storage, not the hub
    assert fetch_mod.get("small", tmp_path / "dl", None, table)[0].read_bytes() == b"{}"


def test_hub_files_offline_every_missing_file_named(server, hub, tmp_path):
    table = table_for(server, tmp_path, {"model": hub_entry("config.json", "vocab.txt",
                                                            sha256="0" * 64, size=8)})
    for env in ({"OFFLINE": "1"}, {"HF_HUB_OFFLINE": "1"}):
        proc = cli("--dir", tmp_path / "dl", "model", env={
            "RDROP_SOURCES": str(table), "HF_ENDPOINT": server.base,
            "HF_HUB_CACHE": str(tmp_path / "hf-cache"), **env})
        assert proc.returncode != 0 and server.log == [] and "Traceback" not in proc.stderr
        for name in ("config.json", "vocab.txt"):
            assert (f"dl/{name} is missing: it comes from {server.base}/org/model/resolve/"
                    f"{REVISION}/{name}") in proc.stderr
        assert proc.stderr.startswith(f"error: {next(iter(env))}=1: ")
        assert proc.stderr.rstrip().endswith("| or set MODEL_DIR")
