#!/usr/bin/env python
"""Download the recipes' inputs: resumed after a cut, verified, with progress.

    python -m rdrop_fairseq.recipes.fetch [--sha256 HEX | --md5 HEX] --out FILE URL [URL ...]
    python -m rdrop_fairseq.recipes.fetch --dir DOWNLOADS NAME[=DEST] [NAME[=DEST] ...]
    python -m rdrop_fairseq.recipes.fetch --list          # the source table, as docs/data.md prints it

The first form fetches one file from the first URL that serves it. The second fetches the
files of the named sources of the source table (``sources.json`` beside this file, or the
JSON file that ``RDROP_SOURCES`` names) into DOWNLOADS, and with ``=DEST`` makes DEST from
them: an archive's top folder, the files themselves, MRPC in the GLUE layout, CNN/DailyMail
in fairseq's ``.source``/``.target`` layout. The recipe scripts' ``prepare`` stages run it.

How a file is fetched:

* with a User-Agent of its own (some hosts refuse Python's default one), through the proxy
  that ``http_proxy`` / ``https_proxy`` name, except for the hosts of ``no_proxy``;
* into ``FILE.partial``, resumed with an HTTP Range request (a server that ignores Range
  sends the whole file again, and the download starts afresh); Ctrl-C keeps the partial file;
* 5xx answers, time-outs and cut connections are retried with back-off (then the next URL);
  403, 404 and other refusals move to the next URL at once, and so does a host that cannot
  be reached at all (refused, unknown, no route, a proxy that refuses, no connection within
  the 5 s all the URLs of a file share: no retries, so that an offline machine gives up
  within about 5 s);
* an HTML page where a file was expected is refused (a login or quota page served with 200);
* the checksum is verified before the file takes its name: nothing appears under FILE
  unless verified. A download with the wrong checksum is kept as ``FILE.bad``, never
  resumed from. Without a known checksum, the SHA-256 of the first download is recorded in
  ``FILE.sha256`` (and printed) once the file has proved whole (an archive read to its end,
  DEST made from it), and checked on later runs;
* a FILE already there with the right checksum is not fetched again; two runs fetching into
  one folder take turns.

Environment: ``OFFLINE=1`` fetches nothing: it names each missing file, where it comes
from and the command that fetches it by hand. ``DRY_RUN=1`` prints each URL and
destination. ``RDROP_SOURCES=table.json`` replaces the source table.
Exit status 0 only when every file asked for is there, verified.
"""

import argparse
import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import shlex
import shutil
import socket
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from .common import ArgumentParser, dry_run

TABLE = Path(__file__).with_name("sources.json")
USER_AGENT = "rdrop-fairseq-fetch/1.0 (+https://pypi.org/project/rdrop-fairseq/)"
CHUNK = 1 << 20
DIGESTS = {"sha256": 64, "md5": 32}
# seconds for all the tries to connect in one fetch() (every URL): an offline machine, or a
# firewall that drops packets, gives up within this
CONNECT_BUDGET = 5.0


class FetchError(Exception):
    """A file that could not be fetched or verified; the message says why and what to do."""


class BadInput(ValueError):
    """An argument refused before anything is fetched."""


def offline():
    return os.environ.get("OFFLINE") == "1"


def say(message):
    print(f"[fetch] {message}", file=sys.stderr, flush=True)


def human(n):
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


# ------------------------------------------------------------------------ checksums


def file_digest(path, algorithm):
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def check_digest(algorithm, value, where=None):
    """``(algorithm, lower-case hex)``, or BadInput saying what is wrong (``where``: the file
    the value was read from; default: the option)."""
    if algorithm not in DIGESTS:
        raise BadInput(f"unknown checksum {algorithm!r}: give sha256 or md5")
    value = value.strip().lower()
    if len(value) != DIGESTS[algorithm] or any(c not in "0123456789abcdef" for c in value):
        raise BadInput(f"{where or '--' + algorithm} must hold {DIGESTS[algorithm]} hex "
                       f"digits, not {value!r}")
    return algorithm, value


def record_path(out):
    return out.with_name(out.name + ".sha256")


def recorded(out):
    """The SHA-256 recorded at the first download of ``out`` (no public checksum), if any."""
    path = record_path(out)
    if path.is_file():
        fields = path.read_text().split()
        if fields:
            return check_digest("sha256", fields[0], where=f"the recorded checksum {path}")
    return None


def archive_check(path, source, name=None):
    """Read an archive whole (a .tar.gz to the end: gzip checks its CRC only there) and
    FetchError if it is corrupt, naming it and ``source``; ``name`` (default: the path's)
    says what kind of file it is. Other files pass."""
    name = name or Path(path).name
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
            if bad:
                raise zipfile.BadZipFile(f"a bad CRC in {bad}")
        elif name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(path) as tar:
                for member in tar:
                    if member.isfile():
                        with tar.extractfile(member) as f:
                            while f.read(CHUNK):
                                pass
                if tar.fileobj is not None:
                    while tar.fileobj.read(CHUNK):
                        pass
        elif name.endswith(".parquet"):
            with open(path, "rb") as f:
                head = f.read(4)
                f.seek(-4, os.SEEK_END)
                if head != b"PAR1" or f.read(4) != b"PAR1":
                    raise ValueError("no parquet magic at its start and end")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise FetchError(f"{path} (from {source}) is corrupt: {e}") from None


@contextlib.contextmanager
def locked(folder):
    """Hold an exclusive lock on ``folder`` (flock of the directory: no lock file is left
    behind): two runs fetching into one folder take turns."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another run fetching into {folder}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def make_folder(folder):
    """``folder`` and its missing parents; returns those made (to remove if left empty).
    BadInput where a path on the way is a file."""
    folder = Path(folder)
    for parent in [folder, *folder.parents]:
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{parent} is a file, not a folder")
    made = [d for d in [folder, *folder.parents] if not d.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return made


def remove_if_empty(folders):
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


# ------------------------------------------------------------------------ one download


class _Answer(Exception):
    """What one try at a URL answered; ``retry``: worth trying the same URL again."""

    def __init__(self, text, retry=False):
        super().__init__(text)
        self.retry = retry


class _ConnectTimeout(OSError):
    """No connection within the connect time-out (a host that drops packets)."""


class _ConnectTimeoutMixin:
    """Connect (and set up a proxy tunnel, and TLS) within ``connect_timeout``; then wait up
    to the request's own time-out for data."""

    connect_timeout = CONNECT_BUDGET

    def connect(self):
        read_timeout, self.timeout = self.timeout, self.connect_timeout
        try:
            super().connect()
        except (socket.timeout, TimeoutError):
            raise _ConnectTimeout(f"no connection within {self.connect_timeout:.1f} s") from None
        finally:
            self.timeout = read_timeout
        self.sock.settimeout(read_timeout)


def _opener(connect_timeout):
    """A new opener: its ProxyHandler reads the proxy variables now; its connections give up
    connecting after ``connect_timeout`` seconds."""
    class Conn(_ConnectTimeoutMixin, http.client.HTTPConnection):
        pass

    class TLSConn(_ConnectTimeoutMixin, http.client.HTTPSConnection):
        pass

    Conn.connect_timeout = TLSConn.connect_timeout = connect_timeout

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(Conn, req)

    class TLSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(TLSConn, req, context=self._context)

    return urllib.request.build_opener(Handler, TLSHandler)


_NO_ROUTE = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN,
             errno.ENETDOWN)


def _unreachable(reason):
    """Whether a URLError's reason means no connection could be made at all."""
    if isinstance(reason, (_ConnectTimeout, ConnectionRefusedError, socket.gaierror)):
        return True
    if isinstance(reason, OSError) and reason.errno in _NO_ROUTE:
        return True
    return isinstance(reason, OSError) and "Tunnel connection failed" in str(reason)


class _Progress:
    """A tqdm bar where stderr is a terminal, else one line every 10 % (every 100 MB when
    the size is unknown)."""

    def __init__(self, name, total, done):
        self.name, self.total, self.done = name, total, done
        self.start, self.start_bytes = time.monotonic(), done
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True,
                                unit_divisor=1000, desc=name, file=sys.stderr)
            except ImportError:
                pass
        self.next_mark = self._mark_after(done)

    def _mark_after(self, done):
        if self.total:
            step = self.total / 10
            return (int(done / step) + 1) * step
        return (done // 100_000_000 + 1) * 100_000_000

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done >= self.next_mark:
            self.next_mark = self._mark_after(self.done)
            self._line()

    def _line(self):
        elapsed = max(time.monotonic() - self.start, 1e-6)
        speed = (self.done - self.start_bytes) / elapsed
        if self.total:
            left = (self.total - self.done) / speed if speed > 0 else float("inf")
            eta = f"{left:.0f} s left" if left != float("inf") else "time left unknown"
            say(f"{self.name}: {100 * self.done / self.total:.0f} % ({human(self.done)} of "
                f"{human(self.total)}, {human(speed)}/s, {eta})")
        else:
            say(f"{self.name}: {human(self.done)} ({human(speed)}/s)")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _looks_like_html(head):
    return head.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html"))


def _try_url(url, partial, name, timeout, connect_timeout, unverifiable):
    """Fetch ``url`` into ``partial``, resuming from its bytes. Returns on a complete body;
    raises _Answer with what went wrong (``retry`` when the same URL may work again).
    ``unverifiable``: no checksum or size will check the file, so a body whose end cannot
    be told from a cut (no Content-Length, not chunked) is refused."""
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = _opener(connect_timeout).open(urllib.request.Request(url, headers=headers),
                                             timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            size = e.headers.get("Content-Range", "").rpartition("/")[2]
            if size == str(have):  # the partial file is complete (a run killed after it)
                return
            partial.unlink()
            raise _Answer("416 for the partial file's range: starting afresh", retry=True)
        raise _Answer(f"{e.code} {e.reason}", retry=e.code >= 500 or e.code == 429)
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise _Answer("timed out", retry=True)
        raise _Answer(f"no connection ({e.reason})", retry=not _unreachable(e.reason))
    except (socket.timeout, TimeoutError):
        raise _Answer("timed out", retry=True)
    except (http.client.HTTPException, OSError) as e:
        raise _Answer(f"no answer ({e.__class__.__name__}: {e})", retry=True)
    with resp:
        length = resp.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        mode = "ab"
        if resp.status == 206:
            start = resp.headers.get("Content-Range", "").partition(" ")[2].partition("-")[0]
            if start != str(have):
                partial.unlink()  # a range we did not ask for: start afresh
                raise _Answer(f"206 for another range ({resp.headers.get('Content-Range')})",
                              retry=True)
        else:
            if have:
                say(f"{name}: the server ignores Range requests; starting afresh")
            mode, have = "wb", 0
        total = have + length if length is not None else None
        if total is None and not resp.chunked and unverifiable:
            raise _Answer("no Content-Length, and no checksum to tell the whole file from a "
                          "cut one")
        ctype = resp.headers.get("Content-Type", "")
        wants_html = name.endswith((".html", ".htm"))
        if not wants_html and ctype.split(";")[0].strip().lower() == "text/html":
            raise _Answer("an HTML page (Content-Type text/html), not the file")
        progress = _Progress(name, total, have)
        try:
            # unbuffered: what write() returned is on disk (a full disk loses nothing)
            with open(partial, mode, buffering=0) as f:
                first = mode == "wb"
                while True:
                    try:
                        block = resp.read1(CHUNK)  # what has arrived: kept on a stall
                    except (socket.timeout, TimeoutError):
                        raise _Answer(f"timed out after {human(progress.done)}", retry=True)
                    except (http.client.HTTPException, OSError) as e:
                        raise _Answer(f"cut after {human(progress.done)} ({e})", retry=True)
                    if not block:
                        break
                    if first and not wants_html and _looks_like_html(block[:64]):
                        f.truncate(0)
                        raise _Answer("an HTML page, not the file")
                    first = False
                    try:
                        view = memoryview(block)
                        while view:
                            view = view[f.write(view):]
                    except OSError as e:
                        if e.errno == errno.ENOSPC:
                            raise FetchError(
                                f"the disk is full: {partial} holds {human(progress.done)} "
                                "so far; free space and run again: the download resumes "
                                "from there") from None
                        raise
                    progress.update(len(block))
        finally:
            progress.close()
        if total is not None and progress.done < total:
            raise _Answer(f"cut after {human(progress.done)} of {human(total)}", retry=True)
        if total is not None and partial.stat().st_size != total:
            partial.unlink()  # written to by something else meanwhile
            raise _Answer(f"{partial} does not hold the {total} bytes received", retry=True)


def fetch(urls, out, *, sha256=None, md5=None, size=None, timeout=30.0, retries=3,
          backoff=1.0, local_hint=None, record=True):
    """Fetch ``out`` from the first of ``urls`` that serves it (see the module's docstring);
    returns ``out``. FetchError says why not; BadInput is bad input, refused before
    anything is fetched. ``local_hint``: how to pass a local copy instead (in the errors).
    ``record``: without a public checksum, record the first download's SHA-256 (False:
    the caller records it once the file has proved whole: ``record_first_seen``)."""
    out = Path(out)
    urls = list(urls)
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"{url!r} is not an http(s) URL")
    if out.is_dir():
        raise BadInput(f"{out} is a folder: give the file to write (--out FILE)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{parent} is a file, not a folder")
    if sha256 and md5:
        raise BadInput("give one checksum: --sha256 or --md5")
    expected = check_digest("sha256", sha256) if sha256 else (
        check_digest("md5", md5) if md5 else recorded(out))
    partial, bad = out.with_name(out.name + ".partial"), out.with_name(out.name + ".bad")
    if dry_run():  # no hashing either: a dry run reads nothing
        mirrors = f" (mirrors: {' '.join(urls[1:])})" if len(urls) > 1 else ""
        there = " (there already)" if out.is_file() else ""
        print(f"++ fetch {urls[0] if urls else '(no URL)'} -> {out}{there}{mirrors}",
              flush=True)
        return out
    if out.is_file():
        return _there_already(out, expected, record)
    by_hand = manual_command(urls, out, expected)
    if offline():
        raise FetchError(f"OFFLINE=1 and {out} is missing: it comes from "
                         f"{' or '.join(urls)}; fetch it by hand: {by_hand}")
    if not urls:
        raise FetchError(f"no URL for {out}")
    made = make_folder(out.parent)
    tried, connecting = [], 0.0  # seconds spent failing to connect, all URLs together
    try:
        with locked(out.parent):
            if out.is_file():  # fetched by the run we waited for
                return _there_already(out, expected, record)
            for url in urls:
                if connecting >= CONNECT_BUDGET:
                    tried.append(f"{url}: not tried (no connection to the URLs before)")
                    continue
                fails = 0
                while True:
                    before = partial.stat().st_size if partial.exists() else 0
                    start = time.monotonic()
                    try:
                        say(f"{out.name}: from {url}" + (f" (resuming at {human(before)})"
                                                         if before else ""))
                        _try_url(url, partial, out.name, timeout,
                                 max(CONNECT_BUDGET - connecting, 0.5),
                                 unverifiable=expected is None and size is None)
                    except _Answer as answer:
                        if str(answer).startswith("no connection"):
                            connecting += time.monotonic() - start
                        progressed = (partial.stat().st_size if partial.exists() else 0) > before
                        fails = 0 if progressed else fails + 1
                        if not answer.retry or fails >= retries:
                            tried.append(f"{url}: {answer}")
                            break
                        delay = backoff * 2 ** max(fails - 1, 0)
                        say(f"{out.name}: {answer}; trying again in {delay:.0f} s")
                        time.sleep(delay)
                        continue
                    problem = _verify(partial, expected, size, url, out.name)
                    if problem is not None:
                        os.replace(partial, bad)
                        tried.append(f"{url}: {problem} (kept as {bad})")
                        break
                    os.replace(partial, out)
                    bad.unlink(missing_ok=True)
                    if expected is None and record:
                        record_first_seen(out)
                    say(f"{out} fetched" + (f", {expected[0]} verified" if expected else ""))
                    return out
    except KeyboardInterrupt:
        if partial.exists() and partial.stat().st_size:
            say(f"interrupted: {partial} keeps {human(partial.stat().st_size)}; "
                "run again to resume")
        raise
    finally:
        if partial.exists() and not partial.stat().st_size:
            partial.unlink()
        remove_if_empty(made)  # only where empty: nothing else is left behind
    reasons = "; ".join(tried)
    hint = f", or {local_hint}" if local_hint else ""
    raise FetchError(f"cannot fetch {out.name}: {reasons}. Fetch it by hand ({by_hand}){hint}")


def _there_already(out, expected, record):
    if expected is None:
        say(f"{out} is there already (no checksum known to verify it)")
        if record:
            record_first_seen(out)
        return out
    got = file_digest(out, expected[0])
    if got == expected[1]:
        say(f"{out} is there already, {expected[0]} verified")
        return out
    raise FetchError(f"{out} is there already, but its {expected[0]} is {got}, not "
                     f"{expected[1]}: it is another file; move it away and run again")


def _verify(path, expected, size, url, name):
    """None if the complete download ``path`` is the file, else what is wrong with it.
    Without a checksum, an archive is read whole (a cut or corrupt one fails)."""
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, not {size}"
    if expected is not None:
        digest = file_digest(path, expected[0])
        return None if digest == expected[1] else \
            f"a file with the wrong checksum ({expected[0]} {digest}, not {expected[1]})"
    try:
        archive_check(path, url, name)
    except FetchError as e:
        return "a corrupt archive (" + str(e).replace(f"{path} (from {url}) is corrupt: ", "") + ")"
    return None


def record_first_seen(out):
    """Record the SHA-256 of ``out`` beside it (no public checksum: later runs check it)."""
    if record_path(out).is_file():
        return
    digest = file_digest(out, "sha256")
    tmp = record_path(out).with_suffix(".tmp")
    tmp.write_text(f"{digest}  {out.name}\n")
    os.replace(tmp, record_path(out))
    say(f"{out.name}: no public checksum; first seen sha256 {digest} "
        f"(recorded in {record_path(out)}, checked on later runs)")


def manual_command(urls, out, expected=None):
    """The command line that fetches ``out`` by hand."""
    cmd = [sys.executable, "-m", "rdrop_fairseq.recipes.fetch"]
    if expected:
        cmd += [f"--{expected[0]}", expected[1]]
    return shlex.join(cmd + ["--out", str(out), *urls])


# ------------------------------------------------------------------------ the table


def load_sources(path=None):
    """The source table: ``{name: entry}`` (``RDROP_SOURCES`` replaces the packaged one)."""
    path = Path(path or os.environ.get("RDROP_SOURCES") or TABLE)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FetchError(f"cannot read the source table {path}: {e}") from None
    seen = {}
    for name, entry in table.items():
        if name.startswith("_"):
            continue
        for f in entry.get("files", []):
            if f["name"] in seen:
                raise FetchError(f"{path}: {name} and {seen[f['name']]} both name {f['name']}")
            seen[f["name"]] = name
    return {k: v for k, v in table.items() if not k.startswith("_")}


def _checksum_of(spec):
    for algorithm in DIGESTS:
        if spec.get(algorithm):
            return algorithm, spec[algorithm]
    return None


def get(name, downloads, dest=None, table=None):
    """The files of source ``name`` in ``downloads`` (fetched if missing), and with ``dest``
    DEST made from them (unless there already). Returns DEST, or the downloaded paths."""
    table = table if table is not None else load_sources()
    if name not in table:
        raise FetchError(f"no source {name!r} in the source table; its sources are "
                         f"{', '.join(sorted(table))}")
    entry = table[name]
    if entry.get("manual"):
        if dry_run():
            print(f"++ (no live source) {name}: {entry['manual']}", flush=True)
            return dest
        raise FetchError(f"{name} has no live source known to us: {entry['manual']}")
    dest = Path(dest) if dest else None
    if dest is not None and dest.exists():
        if not dest.is_dir():
            raise BadInput(f"{dest} is a file: {name} is made as a folder there")
        say(f"{dest} is there already ({name})")
        return dest
    downloads = Path(downloads)
    paths, missing = [], []
    for spec in entry["files"]:
        out = downloads / spec["name"]
        check = _checksum_of(spec)
        try:
            # without a public checksum, a file that DEST is made from is recorded once
            # DEST is made: a file that the making refuses is not pinned
            fetch(spec["urls"], out, size=spec.get("size"), local_hint=entry.get("local"),
                  record=dest is None, **({check[0]: check[1]} if check else {}))
        except FetchError as e:
            if not offline():
                raise
            missing.append(str(e).replace("OFFLINE=1 and ", ""))
        paths.append(out)
    if missing:
        raise FetchError("OFFLINE=1: " + " | ".join(missing)
                         + (f" | or {entry['local']}" if entry.get("local") else ""))
    if dest is None:
        return paths
    if dry_run():
        print(f"++ make {dest} ({entry.get('make', 'copy')}) from "
              f"{', '.join(p.name for p in paths)}", flush=True)
        return dest
    unchecked = [p for p, spec in zip(paths, entry["files"]) if not _checksum_of(spec)]
    try:
        make(entry.get("make", "copy"), paths, dest, entry)
    except FetchError as e:
        if not unchecked:
            raise
        for path in unchecked:  # set aside, so that the next run fetches them afresh
            os.replace(path, path.with_name(path.name + ".bad"))
            record_path(path).unlink(missing_ok=True)
        raise FetchError(f"{e}. No public checksum checked {'them' if len(unchecked) > 1 else 'it'}:"
                         f" set aside as .bad, fetched afresh by the next run") from None
    for path in unchecked:
        record_first_seen(path)
    return dest


def make(kind, paths, dest, entry):
    """DEST from the downloaded ``paths``, made whole in a sibling folder, then renamed.
    FetchError names the files and their source when they cannot be made into DEST."""
    from . import prepare_cnndm, prepare_glue

    made = make_folder(dest.parent)
    source = ", ".join(f["urls"][0] for f in entry["files"])
    try:
        with locked(dest.parent):
            if dest.exists():  # made by the run we waited for
                return
            for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)  # a run killed while making DEST
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            tmp.mkdir()
            try:
                if kind == "copy":
                    for path in paths:
                        shutil.copyfile(path, tmp / path.name)
                elif kind == "unpack":
                    unpack(paths[0], tmp, source)
                elif kind == "mrpc":
                    prepare_glue.mrpc_from_senteval(*paths, tmp)
                elif kind == "cnndm":
                    prepare_cnndm.from_parquet(paths, tmp)
                else:
                    raise FetchError(f"unknown way to make {dest}: {kind!r}")
                os.replace(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except (OSError, ValueError, KeyError, prepare_glue.GlueDataError) as e:
        remove_if_empty(made)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise FetchError(f"the disk is full while making {dest}: free space and run "
                             "again") from None
        names = ", ".join(str(p) for p in paths)
        raise FetchError(f"{names} (from {source}) cannot be made into {dest}: "
                         f"{e.__class__.__name__}: {e}") from None
    except BaseException:
        remove_if_empty(made)
        raise
    say(f"{dest} made from {', '.join(p.name for p in paths)}")


def unpack(archive, into, source):
    """The archive's files into ``into``, without their common top folder (``roberta.base/``,
    ``RTE/``); a corrupt archive is FetchError naming it and ``source``."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                names = [n for n in zf.namelist() if not n.endswith("/")]
                top = _common_top(names)
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    rel = Path(info.filename[len(top):])
                    if rel.is_absolute() or ".." in rel.parts:
                        raise FetchError(f"{archive} holds an unsafe path {info.filename!r}")
                    (into / rel).parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(info) as src, open(into / rel, "wb") as dst:
                        shutil.copyfileobj(src, dst, CHUNK)
        else:
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.isfile()]
                top = _common_top([m.name for m in members])
                for m in members:
                    m.name = m.name[len(top):]
                tar.extractall(into, members=members, filter="data")
                if tar.fileobj is not None:  # gzip checks its CRC at the end only
                    while tar.fileobj.read(CHUNK):
                        pass
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise FetchError(f"{archive} (from {source}) cannot be extracted: {e}") from None


def _common_top(names):
    """``"top/"`` when every name lies under one top folder, else ``""``."""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and all("/" in n for n in names):
        return tops.pop() + "/"
    return ""


def markdown_table(table=None):
    """The source table as docs/data.md prints it."""
    table = table if table is not None else load_sources()
    rows = ["| source | file | size | checksum | licence | recipes |",
            "|---|---|---|---|---|---|"]
    for name, entry in table.items():
        if entry.get("manual"):
            rows.append(f"| {name} | no live source: {entry['manual']} | | | "
                        f"{entry.get('licence', '')} | {entry.get('used_by', '')} |")
            continue
        for spec in entry["files"]:
            check = _checksum_of(spec)
            check = (f"{check[0]} `{check[1][:12]}…` ({entry.get('checksum_from', 'public')})"
                     if check else "first seen: recorded at the first download")
            size = human(spec["size"]) if spec.get("size") else "–"
            link = f"[{spec['name']}]({spec['urls'][0]})"
            rows.append(f"| {name} | {link} | {size} | {check} | {entry.get('licence', '')} | "
                        f"{entry.get('used_by', '')} |")
    return "\n".join(rows) + "\n"


def main(argv=None):
    doc = __doc__.split("\n\n")
    p = ArgumentParser(prog="python -m rdrop_fairseq.recipes.fetch", description=doc[0],
                       epilog="\n\n".join(doc[1:]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", metavar="URL | NAME[=DEST]",
                   help="with --out: the URLs to try in order; with --dir: source names")
    p.add_argument("--out", type=Path, help="the file to write (with URLs)")
    check = p.add_mutually_exclusive_group()
    check.add_argument("--sha256", help="the file's SHA-256 (with --out)")
    check.add_argument("--md5", help="the file's MD5 (with --out)")
    p.add_argument("--dir", type=Path, help="where the named sources' files go")
    p.add_argument("--list", action="store_true", help="print the source table (markdown)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds without data before a try counts as timed out (default 30)")
    p.add_argument("--retries", type=int, default=3,
                   help="tries per URL on 5xx, time-outs and cuts (default 3)")
    a = p.parse_args(argv)
    if a.list:
        print(markdown_table(), end="")
        return
    if bool(a.out) == bool(a.dir):
        p.error("give --out FILE with URLs, or --dir DOWNLOADS with source names")
    if not a.items:
        p.error("nothing to fetch: give URLs (with --out) or source names (with --dir)")
    try:
        if a.out:
            fetch(a.items, a.out, sha256=a.sha256, md5=a.md5, timeout=a.timeout,
                  retries=a.retries)
            return
        if a.sha256 or a.md5:
            p.error("--sha256/--md5 go with --out; the table holds the sources' checksums")
        table = load_sources()
        errors = []
        for item in a.items:
            name, _, dest = item.partition("=")
            try:
                get(name, a.dir, dest or None, table)
            except FetchError as e:
                if not offline():
                    raise
                errors.append(str(e))  # OFFLINE=1: name every missing input, then fail
        if errors:
            raise FetchError("\n".join(errors))
    except BadInput as e:
        p.error(str(e))
    except FetchError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
