"""The downloader keeps only what it can vouch for, against a loopback server that answers
as scripted, header by header: a 206 that starts elsewhere, a 200 or a 416 whose
Content-Range says otherwise, a validator from another mirror, statuses that are not the
file, headers and Locations that break parsers, credentials that a pattern would miss,
bodies longer than their promise or the disk, a trickle, a partial that is a symbolic link.
Without a checksum (``--out`` alone, or a table file without a public record) nothing but
the framing of the answers tells the file from another."""

import gzip
import http.server
import io
import os
import threading
import time
import zipfile

import pytest

from rdrop_fairseq.recipes import fetch as fetch_mod
from tests.test_fetch import DATA, NO_PROXY, SHA, a_new_run, cli, only, table_for  # noqa: F401
from tests.test_fetch_edges import one_line

NEW = DATA[::-1]  # another file
N = len(DATA)
DATE = "Mon, 01 Jan 2024 00:00:00 GMT"
MAX_REQUESTS = 20  # a client that loops is stopped here: the test fails, it does not hang


def answer(status=200, headers=(), body=b"", cut=None, trickle=None, length=True,
           ranged=False):
    """One scripted answer: ``headers`` as sent (a Content-Length of the body added unless
    given or ``length`` is False: then the body ends with the connection); ``cut``: bytes
    sent before the connection drops; ``trickle``: ``(seconds, bytes)``, one byte of the
    body every ``seconds``, at most ``bytes`` of them; ``ranged``: a Range is answered with
    a 206 of the body from the byte asked for (whatever If-Range says)."""
    return dict(status=status, headers=list(headers), body=body, cut=cut, trickle=trickle,
                length=length, ranged=ranged)


class Scripted(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.log, self.stop = {}, [], threading.Event()

    def url(self, path, userinfo=""):
        return f"http://{userinfo}127.0.0.1:{self.server_address[1]}{path}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        log = self.server.log
        log.append((self.path, self.headers.get("Range"), self.headers.get("If-Range")))
        answers = self.server.script.get(self.path)
        if not answers or len(log) > MAX_REQUESTS:
            self.send_error(404)
            return
        a = answers.pop(0) if len(answers) > 1 else answers[0]  # the last one repeats
        if a["ranged"] and self.headers.get("Range"):
            start, n = int(self.headers["Range"][6:].rstrip("-")), len(a["body"])
            a = dict(a, status=206, body=a["body"][start:], headers=a["headers"] + [
                ("Content-Range", f"bytes {start}-{n - 1}/{n}")])
        self.send_response(a["status"])
        names = [h.lower() for h, _ in a["headers"]]
        for header, value in a["headers"]:
            self.send_header(header, value)
        if a["length"] and "content-length" not in names:
            self.send_header("Content-Length", str(len(a["body"])))
        if not a["length"]:
            self.close_connection = True
        self.end_headers()
        if a["trickle"]:
            every, count = a["trickle"]
            for byte in a["body"][:count]:
                if self.server.stop.wait(every):
                    break
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(a["body"][:a["cut"]])
        if a["cut"] is not None:
            self.close_connection = True


@pytest.fixture
def scripted(monkeypatch):
    for key, value in NO_PROXY.items():
        monkeypatch.setenv(key, value)
    srv = Scripted()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.stop.set()
    srv.shutdown()
    srv.server_close()


def ranges(srv):
    return [(r, i) for _, r, i in srv.log]


def whole(data=DATA, **headers):
    return answer(200, headers.items(), data)


# ------------------------------------------------------------------ framing


def test_a_206_to_a_request_without_range_that_starts_elsewhere_is_refused(scripted, tmp_path):
    scripted.script["/a.bin"] = [answer(206, [("Content-Range", f"bytes 500-{N - 1}/{N}")],
                                        DATA[500:])]
    proc = cli("--out", tmp_path / "a.bin", scripted.url("/a.bin"))
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "a 206 that holds bytes 500-" in line, proc.stderr
    assert only(tmp_path / "a.bin") == []  # nothing kept, under any name


def test_a_resume_answered_200_with_a_content_range_of_the_rest_is_refused(scripted,
                                                                          tmp_path):
    """The first answer is cut at 300 kB; the server answers the resume with a 200 that
    holds only the rest, as its Content-Range says."""
    etag = [("ETag", '"v1"')]
    scripted.script["/a.bin"] = [
        answer(200, etag, DATA, cut=300_000),
        answer(200, etag + [("Content-Range", f"bytes 300000-{N - 1}/{N}")], DATA[300_000:])]
    proc = cli("--out", tmp_path / "a.bin", scripted.url("/a.bin"))
    assert proc.returncode == 1, proc.stderr
    assert "a 200 whose Content-Range says it holds bytes 300000-" in proc.stderr
    assert not (tmp_path / "a.bin").exists()
    assert (tmp_path / "a.bin.partial").read_bytes() == DATA[:300_000]  # kept to resume
    assert ranges(scripted) == [(None, None), ("bytes=300000-", '"v1"')]


def test_a_416_whose_total_is_not_the_one_promised_proves_nothing(scripted, tmp_path):
    """The first answer promised 1 MiB and was cut at 300 kB; the resume is answered 416
    with a total of 300 kB: the partial is not the whole file, which is asked for again."""
    etag = [("ETag", '"v1"')]
    scripted.script["/a.bin"] = [answer(200, etag, DATA, cut=300_000),
                                 answer(416, etag + [("Content-Range", "bytes */300000")]),
                                 answer(200, etag, DATA)]
    proc = cli("--out", tmp_path / "a.bin", scripted.url("/a.bin"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a.bin").read_bytes() == DATA  # not its first 300 kB
    assert ranges(scripted) == [(None, None), ("bytes=300000-", '"v1"'), (None, None)]


def test_a_validator_is_not_sent_to_another_mirror(scripted, tmp_path):
    """Mirror A's file is cut, then A is gone; mirror B serves another file with the same
    Last-Modified, and honours If-Range with it: resumed there, it would be spliced."""
    lm = [("Last-Modified", DATE)]
    scripted.script["/a/f.bin"] = [answer(200, lm, DATA, cut=300_000), answer(404)]
    scripted.script["/b/f.bin"] = [answer(200, lm, NEW, ranged=True)]
    proc = cli("--out", tmp_path / "f.bin", scripted.url("/a/f.bin"),
               scripted.url("/b/f.bin"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "f.bin").read_bytes() == NEW  # B's file, whole
    assert [(p, r) for p, r, _ in scripted.log][-1] == ("/b/f.bin", None)


@pytest.mark.parametrize("status, headers", [(302, []), (300, [("Location", "")]), (304, [])],
                         ids=["302 without Location", "300", "304"])
def test_a_status_that_is_not_followed_is_an_error(scripted, tmp_path, status, headers):
    body = b"" if status == 304 else b"not the file"
    scripted.script["/a.bin"] = [answer(status, headers, body)]
    proc = cli("--out", tmp_path / "a.bin", scripted.url("/a.bin"))
    assert proc.returncode == 1 and f": {status} " in proc.stderr, proc.stderr
    assert only(tmp_path / "a.bin") == []


# ------------------------------------------------------------------ one line, no password


@pytest.mark.parametrize("headers", [
    [("Content-Length", "\u00b2")],  # str.isdigit() takes it; int() does not
    [("Location", "http://[::1")],
    [("Location", "http://\udcff\udcfe/x".encode("utf-8", "surrogateescape").decode("latin-1"))],
    [("Location", "http://" + "a" * 300 + ".example/x")],
], ids=["superscript length", "bracket", "not UTF-8", "long label"])
def test_headers_that_break_parsers_are_one_line(scripted, tmp_path, headers):
    status = 302 if headers[0][0] == "Location" else 200
    scripted.script["/a.bin"] = [answer(status, headers, b"x" if status == 200 else b"",
                                        length=status != 200)]
    line = one_line_or_last(cli("--out", tmp_path / "a.bin", scripted.url("/a.bin")))
    assert line.startswith("error: cannot fetch a.bin: ") and "Traceback" not in line, line
    assert only(tmp_path / "a.bin") == []


def one_line_or_last(proc):
    """The error line, with no traceback above it (the progress lines of [fetch] may be)."""
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[fetch]")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_url_with_a_line_break_is_one_line(scripted, tmp_path):
    line = one_line(cli("--out", tmp_path / "a.bin", scripted.url("/a\r\nX-Evil: 1")))
    assert "holds a control character" in line and scripted.log == []


@pytest.mark.parametrize("userinfo, secrets", [
    ("user:s3 cret@", ["s3 cret", "cret"]),
    ("user:top@secret@", ["top", "secret"]),
    ("us%40er:p%40ss@", ["p%40ss", "p@ss"]),
], ids=["a space", "an @", "percent-encoded"])
def test_credentials_are_masked_whatever_they_hold(scripted, tmp_path, userinfo, secrets):
    url = scripted.url("/gone.bin", userinfo)  # 404: the error names every URL tried
    for env in ({}, {"OFFLINE": "1"}, {"DRY_RUN": "1"}):
        proc = cli("--out", tmp_path / "a.bin", url, env=env)
        text = proc.stdout + proc.stderr
        assert "://***@127.0.0.1" in text and not any(s in text for s in secrets), text


# ------------------------------------------------------------------ caps


def test_a_body_longer_than_the_pinned_size_is_cut_off_and_discarded(scripted, tmp_path):
    """An endless body (here 1 MiB, without a length) for a file pinned at 1000 bytes."""
    scripted.script["/e.bin"] = [answer(200, [], DATA, length=False)]
    table = table_for(scripted, tmp_path, {"src": {"files": [
        {"name": "e.bin", "urls": [scripted.url("/e.bin")], "size": 1000,
         "no_public_record": "a test"}]}})
    proc = cli("--dir", tmp_path / "dl", "src", env={"RDROP_SOURCES": str(table)})
    assert proc.returncode == 1 and "more than the 1000 bytes" in proc.stderr, proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert "e.bin.partial discarded, not resumed" in line and "resumes from" not in line
    # discarded: nothing to resume from, and the folder the run made is gone with it
    assert not (tmp_path / "dl").exists()


def test_a_decoded_body_larger_than_the_free_space_is_stopped(scripted, tmp_path,
                                                              monkeypatch):
    """gzip on the way, 1 MiB decoded from 4 kB, on a disk with 100 kB free."""
    scripted.script["/a.bin"] = [answer(200, [("Content-Encoding", "gzip")],
                                        gzip.compress(DATA, mtime=0))]
    free = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
        (*free[:4], 100_000 // free.f_frsize, *free[5:])))
    with pytest.raises(fetch_mod.FetchError, match="more than the free space on its disk"):
        fetch_mod.fetch([scripted.url("/a.bin")], tmp_path / "a.bin", sha256=SHA)
    assert only(tmp_path / "a.bin") == []


def test_an_archive_larger_unpacked_than_the_free_space_is_not_unpacked(scripted, tmp_path,
                                                                       monkeypatch):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("top/zeros.bin", bytes(N))  # 1 MiB declared, 1 kB stored
    scripted.script["/m.zip"] = [whole(buf.getvalue())]
    table = fetch_mod.load_sources(table_for(scripted, tmp_path, {"m": {
        "make": "unpack", "files": [{"name": "m.zip", "urls": [scripted.url("/m.zip")],
                                     "no_public_record": "a test"}]}}))
    fetch_mod.get("m", tmp_path / "dl", None, table)  # the download itself is small
    free = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
        (*free[:4], 100_000 // free.f_frsize, *free[5:])))
    with pytest.raises(fetch_mod.FetchError, match=f"unpacks to {N / 1e6:.2f}MB, more than "):
        fetch_mod.get("m", tmp_path / "dl", tmp_path / "m", table)
    assert not (tmp_path / "m").exists() and (tmp_path / "dl" / "m.zip").is_file()


def test_a_trickle_ends_the_try_within_the_timeout(scripted, tmp_path):
    """One byte every 0.2 s, with --timeout 1: each try ends after about a second, the
    second try is the last (--retries 2), and the partial is kept to resume."""
    scripted.script["/a.bin"] = [answer(200, [("ETag", '"v1"')], DATA, trickle=(0.2, 200))]
    began = time.monotonic()
    proc = cli("--timeout", "1", "--retries", "2", "--out", tmp_path / "a.bin",
               scripted.url("/a.bin"), timeout=20)
    assert time.monotonic() - began < 10
    line = one_line_or_last(proc)
    assert proc.returncode == 1 and "less than 1 KiB in 1 s" in line, proc.stderr
    assert len(scripted.log) == 2 and (tmp_path / "a.bin.partial").stat().st_size > 0


def test_a_partial_that_is_a_symbolic_link_is_not_written_through(scripted, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(DATA[:300_000])
    (tmp_path / "a.bin.partial").symlink_to(victim)
    scripted.script["/a.bin"] = [whole(DATA)]
    line = one_line(cli("--sha256", SHA, "--out", tmp_path / "a.bin", scripted.url("/a.bin")))
    assert "a.bin.partial is a symbolic link" in line
    assert victim.read_bytes() == DATA[:300_000] and not (tmp_path / "a.bin").exists()
