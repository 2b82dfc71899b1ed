"""The recipes' downloader (rdrop_fairseq.recipes.fetch) against a loopback HTTP server that
the tests start on 127.0.0.1: cuts resumed with Range, mirrors after a 404, a host that
refuses Python's default User-Agent, wrong checksums, servers that ignore Range, HTML pages
served with 200, proxies, Ctrl-C, a full disk and no network at all."""

import errno
import hashlib
import http.client
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from rdrop_fairseq.recipes.fetch import FetchError, fetch
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
    (bytes sent before the server waits)."""


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes, self.log = {}, []

    @property
    def base(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, path):
        return self.base + path


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        # a proxied request names the whole URL: serve it by its path too
        path = "/" + self.path.split("://", 1)[1].split("/", 1)[1] if "://" in self.path \
            else self.path
        route = self.server.routes.get(path)
        self.server.log.append({"path": path, "raw_path": self.path,
                                "range": self.headers.get("Range"),
                                "agent": self.headers.get("User-Agent")})
        if route is None:
            return self._error(404)
        if route.get("refuse_python_ua") and "Python-urllib" in self.headers.get("User-Agent", ""):
            return self._error(403)
        if route.get("status"):
            return self._error(route["status"])
        data, start = route["data"], 0
        rng = self.headers.get("Range")
        if rng and route.get("ranges", True):
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "text/html" if route.get("html") else
                         "application/octet-stream")
        if route.get("no_length"):  # the body ends where the connection closes
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
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

    def _error(self, code):
        body = f"<html><body>{code}</body></html>".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


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
    """The names in ``path``'s folder."""
    return sorted(p.name for p in Path(path).parent.iterdir())


def test_a_cut_download_resumes_with_a_range_request(server, tmp_path, capsys):
    server.routes["/a.bin"] = Route(data=DATA, cut=300_000)
    out = fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA, backoff=0)
    assert out.read_bytes() == DATA
    assert [r["range"] for r in server.log] == [None, "bytes=300000-"]
    assert only(out) == ["a.bin"]  # no .partial, no record: the checksum is public
    err = capsys.readouterr().err
    assert "cut after 300.0 kB of 1.0 MB" in err and "resuming at 300.0 kB" in err
    # not a terminal: a line every 10 %, the last at 100 %
    assert "a.bin: 100 % (1.0 MB of 1.0 MB" in err and "s left" in err


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
    assert list(tmp_path.iterdir()) == []


def test_a_verified_file_is_not_fetched_again(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    for _ in range(2):
        assert cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin")).returncode == 0
    assert len(server.log) == 1
    (tmp_path / "a.bin").write_bytes(b"another file")
    proc = cli("--sha256", SHA, "--out", tmp_path / "a.bin", server.url("/a.bin"))
    assert proc.returncode != 0 and "it is another file" in proc.stderr
    assert (tmp_path / "a.bin").read_bytes() == b"another file"  # left as the user put it


def test_without_a_public_checksum_the_first_one_is_recorded_and_checked(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA)
    proc = cli("--out", tmp_path / "a.bin", server.url("/a.bin"))
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


def test_a_full_disk_is_a_clear_error_and_the_partial_stays(server, tmp_path, monkeypatch):
    server.routes["/a.bin"] = Route(data=DATA)
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.written = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if self.written + len(data) > 400_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += self.f.write(data)
            return len(data)

    monkeypatch.setattr(fetch_mod, "open", lambda *a, **k: Full(real_open(*a, **k)),
                        raising=False)
    with pytest.raises(FetchError, match="the disk is full: .*a.bin.partial holds"):
        fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA)
    assert (tmp_path / "a.bin.partial").stat().st_size > 0 and not (tmp_path / "a.bin").exists()


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
    assert "Fetch it by hand" in proc.stderr
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


def table_for(server, tmp_path, entries):
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(entries))
    return path


def test_named_sources_offline_and_dry_run(server, tmp_path):
    server.routes["/w.zip"] = Route(data=DATA)
    table = table_for(server, tmp_path, {
        "corpus": {"files": [{"name": "w.zip", "urls": [server.url("/w.zip")], "sha256": SHA}],
                   "local": "set SOURCE to a local w.zip"},
        "other": {"files": [{"name": "o.bin", "urls": [server.url("/o.bin")]}]},
        "gone": {"files": [], "manual": "no host serves it; set X to your copy"}})
    env = {"RDROP_SOURCES": str(table)}
    dl = tmp_path / "dl"
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


def test_the_packaged_table_is_well_formed():
    table = fetch_mod.load_sources(fetch_mod.TABLE)
    for name, entry in table.items():
        assert entry.get("licence") and entry.get("used_by"), name
        if entry.get("manual"):
            continue
        assert entry["files"] and entry.get("local"), name
        for spec in entry["files"]:
            assert all(u.startswith("https://") or u.startswith("http://") for u in spec["urls"])
            for algorithm, digits in fetch_mod.DIGESTS.items():
                if algorithm in spec:
                    assert fetch_mod.check_digest(algorithm, spec[algorithm])
    # the inputs the issue names: each recipe's
    for name in ["wikitext-103", "iwslt14-de-en", "wmt13-europarl-v7", "glue-RTE", "glue-MRPC",
                 "glue-QQP", "gpt2-bpe", "roberta.base", "roberta.large", "bart.large",
                 "cnn_dailymail", "bert-base-uncased"]:
        assert name in table
    assert table["wikitext-103"]["files"][0]["md5"] == "9ddaacaf6af0710eda8c456decff7832"
    for manual in ["iwslt14-en-fr", "iwslt14-en-es", "iwslt17-en-zh", "wmt16-google-en-de"]:
        assert table[manual]["manual"]


def test_a_corrupt_archive_without_a_checksum_names_the_file_and_its_source(server, tmp_path):
    server.routes["/model.tar.gz"] = Route(data=b"\x1f\x8b" + DATA[:5000])  # not a tarball
    table = table_for(server, tmp_path, {"model": {
        "files": [{"name": "model.tar.gz", "urls": [server.url("/model.tar.gz")]}],
        "make": "unpack"}})
    dest = tmp_path / "work" / "model"
    proc = cli("--dir", tmp_path / "dl", f"model={dest}", env={"RDROP_SOURCES": str(table)})
    assert proc.returncode != 0
    assert f"{server.url('/model.tar.gz')}: a corrupt archive (" in proc.stderr
    assert f"kept as {tmp_path / 'dl' / 'model.tar.gz.bad'}" in proc.stderr
    assert not (tmp_path / "work").exists()  # no DEST, no half-made sibling, no empty parent


def test_a_corrupt_archive_is_not_pinned_by_a_first_seen_checksum(server, tmp_path):
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w:gz") as tar:
        info = tarfile.TarInfo("model/model.pt")
        info.size = len(DATA)
        tar.addfile(info, io.BytesIO(DATA))
    good = good.getvalue()
    corrupt = good[:-8] + bytes(8)  # the gzip trailer's CRC: tarfile alone never reads it
    server.routes["/model.tar.gz"] = Route(data=corrupt)
    table = table_for(server, tmp_path, {"model": {
        "files": [{"name": "model.tar.gz", "urls": [server.url("/model.tar.gz")]}],
        "make": "unpack"}})
    dl, dest = tmp_path / "dl", tmp_path / "work" / "model"
    env = {"RDROP_SOURCES": str(table)}
    proc = cli("--dir", dl, f"model={dest}", env=env)
    assert proc.returncode != 0 and "a corrupt archive (CRC check failed" in proc.stderr
    assert sorted(p.name for p in dl.iterdir()) == ["model.tar.gz.bad"]  # no record
    server.routes["/model.tar.gz"] = Route(data=good)
    proc = cli("--dir", dl, f"model={dest}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "model.pt").read_bytes() == DATA
    assert sorted(p.name for p in dl.iterdir()) == ["model.tar.gz", "model.tar.gz.sha256"]
    assert (dl / "model.tar.gz.sha256").read_text().split()[0] == hashlib.sha256(good).hexdigest()


def test_a_body_without_a_length_needs_a_checksum(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, no_length=True)
    with pytest.raises(FetchError, match="no Content-Length, and no checksum"):
        fetch([server.url("/a.bin")], tmp_path / "a.bin", backoff=0)
    assert fetch([server.url("/a.bin")], tmp_path / "a.bin", sha256=SHA).read_bytes() == DATA


def test_two_runs_fetching_one_file_take_turns(server, tmp_path):
    server.routes["/a.bin"] = Route(data=DATA, stall=100_000, stall_s=1)
    env = {**os.environ, **NO_PROXY, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "rdrop_fairseq.recipes.fetch", "--out",
                               str(tmp_path / "a.bin"), server.url("/a.bin")], env=env,
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


def test_a_host_that_drops_packets_is_given_up_within_the_connect_budget(tmp_path,
                                                                        monkeypatch):
    def black_hole(address, timeout=None, *args, **kwargs):
        time.sleep(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(http.client.socket, "create_connection", black_hole)
    monkeypatch.setattr(fetch_mod, "CONNECT_BUDGET", 1.0)
    start = time.monotonic()
    with pytest.raises(FetchError) as e:
        fetch(["http://10.255.255.1/a.bin", "http://10.255.255.2/a.bin"], tmp_path / "a.bin",
              sha256=SHA, backoff=0)
    assert time.monotonic() - start < 2.5  # not 2 URLs x 3 tries x 30 s
    assert "no connection within 1.0 s" in str(e.value)
    assert "10.255.255.2/a.bin: not tried" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_files_that_cannot_be_made_into_dest_are_one_line_and_set_aside(server, tmp_path):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    server.routes["/train.txt"] = Route(data=(header + "1\t1\t2\ta b\tc d\n").encode())
    server.routes["/test.txt"] = Route(data=(header + "1\t3\t4\te f\tg h\n").encode())
    server.routes["/ids.tsv"] = Route(data=b"8\t9\n")  # a pair the training file lacks
    table = table_for(server, tmp_path, {"glue-MRPC": {"make": "mrpc", "files": [
        {"name": n, "urls": [server.url("/" + n)]} for n in ("train.txt", "test.txt",
                                                             "ids.tsv")]}})
    proc = cli("--dir", tmp_path / "dl", f"glue-MRPC={tmp_path / 'work' / 'MRPC'}",
               env={"RDROP_SOURCES": str(table)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cannot be made into" in proc.stderr and "ids.tsv lists 1 pairs" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == [
        "ids.tsv.bad", "test.txt.bad", "train.txt.bad"]  # no first-seen record pins them
    assert not (tmp_path / "work").exists()
