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
  be reached at all (refused, unknown, a proxy that refuses: no retries, so that an offline
  machine gives up within seconds);
* an HTML page where a file was expected is refused (a login or quota page served with 200);
* the checksum is verified before the file takes its name: nothing appears under FILE
  unless verified. A download with the wrong checksum is kept as ``FILE.bad``, never
  resumed from. Without a known checksum, the SHA-256 of the first download is recorded in
  ``FILE.sha256`` (and printed), and checked on later runs;
* a FILE already there with the right checksum is not fetched again.

Environment: ``OFFLINE=1`` fetches nothing: it names each missing file, where it comes
from and the command that fetches it by hand. ``DRY_RUN=1`` prints each URL and
destination. ``RDROP_SOURCES=table.json`` replaces the source table.
Exit status 0 only when every file asked for is there, verified.
"""

import argparse
import contextlib
import errno
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


class FetchError(Exception):
    """A file that could not be fetched or verified; the message says why and what to do."""


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


def check_digest(algorithm, value):
    """``(algorithm, lower-case hex)``, or ValueError saying what is wrong."""
    if algorithm not in DIGESTS:
        raise ValueError(f"unknown checksum {algorithm!r}: give sha256 or md5")
    value = value.strip().lower()
    if len(value) != DIGESTS[algorithm] or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"--{algorithm} must be {DIGESTS[algorithm]} hex digits, not {value!r}")
    return algorithm, value


def record_path(out):
    return out.with_name(out.name + ".sha256")


def recorded(out):
    """The SHA-256 recorded at the first download of ``out`` (no public checksum), if any."""
    path = record_path(out)
    if path.is_file():
        fields = path.read_text().split()
        if fields:
            return check_digest("sha256", fields[0])
    return None


# ------------------------------------------------------------------------ one download


class _Answer(Exception):
    """What one try at a URL answered; ``retry``: worth trying the same URL again."""

    def __init__(self, text, retry=False):
        super().__init__(text)
        self.retry = retry


def _unreachable(reason):
    """Whether a URLError's reason means no connection could be made at all."""
    if isinstance(reason, (ConnectionRefusedError, socket.gaierror)):
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


def _try_url(url, partial, name, timeout):
    """Fetch ``url`` into ``partial``, resuming from its bytes. Returns on a complete body;
    raises _Answer with what went wrong (``retry`` when the same URL may work again)."""
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        # a new opener each time: its ProxyHandler reads the proxy variables now
        resp = urllib.request.build_opener().open(urllib.request.Request(url, headers=headers),
                                                  timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the partial file is as long as the file, or longer
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


def fetch(urls, out, *, sha256=None, md5=None, size=None, timeout=30.0, retries=3,
          backoff=1.0, local_hint=None):
    """Fetch ``out`` from the first of ``urls`` that serves it (see the module's docstring);
    returns ``out``. FetchError says why not; ValueError is bad input, refused before
    anything is fetched. ``local_hint``: how to pass a local copy instead (in the errors)."""
    out = Path(out)
    urls = list(urls)
    for url in urls:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"{url!r} is not an http(s) URL")
    if out.is_dir():
        raise ValueError(f"{out} is a folder: give the file to write (--out FILE)")
    if sha256 and md5:
        raise ValueError("give one checksum: --sha256 or --md5")
    expected = check_digest("sha256", sha256) if sha256 else (
        check_digest("md5", md5) if md5 else recorded(out))
    partial, bad = out.with_name(out.name + ".partial"), out.with_name(out.name + ".bad")
    if dry_run():  # no hashing either: a dry run reads nothing
        print(f"++ fetch {urls[0] if urls else '(no URL)'} -> {out}"
              + (" (there already)" if out.is_file() else ""), flush=True)
        return out
    if out.is_file():
        if expected is None:
            say(f"{out} is there already (no checksum known to verify it)")
            return out
        got = file_digest(out, expected[0])
        if got == expected[1]:
            say(f"{out} is there already, {expected[0]} verified")
            return out
        raise FetchError(f"{out} is there already, but its {expected[0]} is {got}, not "
                         f"{expected[1]}: it is another file; move it away and run again")
    by_hand = manual_command(urls, out, expected)
    if offline():
        raise FetchError(f"OFFLINE=1 and {out} is missing: it comes from "
                         f"{' or '.join(urls)}; fetch it by hand: {by_hand}")
    if not urls:
        raise FetchError(f"no URL for {out}")
    made = [d for d in [out.parent, *out.parent.parents] if not d.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tried = []
    try:
        for url in urls:
            fails = 0
            while True:
                before = partial.stat().st_size if partial.exists() else 0
                try:
                    say(f"{out.name}: from {url}" + (f" (resuming at {human(before)})"
                                                     if before else ""))
                    _try_url(url, partial, out.name, timeout)
                except _Answer as answer:
                    progressed = (partial.stat().st_size if partial.exists() else 0) > before
                    fails = 0 if progressed else fails + 1
                    if not answer.retry or fails >= retries:
                        tried.append(f"{url}: {answer}")
                        break
                    delay = backoff * 2 ** max(fails - 1, 0)
                    say(f"{out.name}: {answer}; trying again in {delay:.0f} s")
                    time.sleep(delay)
                    continue
                # complete: verify before it takes its name
                if size is not None and partial.stat().st_size != size:
                    got = f"{partial.stat().st_size} bytes, not {size}"
                elif expected is not None:
                    digest = file_digest(partial, expected[0])
                    got = None if digest == expected[1] else \
                        f"{expected[0]} {digest}, not {expected[1]}"
                else:
                    got = None
                if got is not None:
                    os.replace(partial, bad)
                    tried.append(f"{url}: a file with the wrong checksum ({got}; kept as {bad})")
                    break
                if expected is None:
                    digest = file_digest(partial, "sha256")
                    record_path(out).write_text(f"{digest}  {out.name}\n")
                    say(f"{out.name}: no public checksum; first seen sha256 {digest} "
                        f"(recorded in {record_path(out)}, checked on later runs)")
                os.replace(partial, out)
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
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only where empty: nothing else is left behind
    reasons = "; ".join(tried)
    hint = f", or {local_hint}" if local_hint else ""
    raise FetchError(f"cannot fetch {out.name}: {reasons}. Fetch it by hand ({by_hand}){hint}")


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
        raise FetchError(f"no source {name!r} in the table; the sources are "
                         f"{', '.join(sorted(table))}")
    entry = table[name]
    if entry.get("manual"):
        if dry_run():
            print(f"++ (no live source) {name}: {entry['manual']}", flush=True)
            return dest
        raise FetchError(f"{name} has no live source known to us: {entry['manual']}")
    dest = Path(dest) if dest else None
    if dest is not None and dest.exists():
        say(f"{dest} is there already ({name})")
        return dest
    downloads = Path(downloads)
    paths, missing_paths = [], []
    for spec in entry["files"]:
        out = downloads / spec["name"]
        try:
            fetch(spec["urls"], out, size=spec.get("size"), local_hint=entry.get("local"),
                  **({k: v for k, v in [_checksum_of(spec)]} if _checksum_of(spec) else {}))
        except FetchError as e:
            if not offline():
                raise
            missing_paths.append(str(e).replace("OFFLINE=1 and ", ""))
        paths.append(out)
    if missing_paths:
        raise FetchError("OFFLINE=1: " + " | ".join(missing_paths)
                         + (f" | or {entry['local']}" if entry.get("local") else ""))
    if dest is None:
        return paths
    if dry_run():
        print(f"++ make {dest} ({entry.get('make', 'copy')}) from "
              f"{', '.join(p.name for p in paths)}", flush=True)
        return dest
    make(entry.get("make", "copy"), paths, dest, entry)
    return dest


def make(kind, paths, dest, entry):
    """DEST from the downloaded ``paths``, made whole in a sibling folder, then renamed."""
    from . import prepare_cnndm, prepare_glue

    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a run killed while making DEST
    made_parent = not dest.parent.exists()
    tmp.mkdir(parents=True)
    try:
        if kind == "copy":
            for path in paths:
                shutil.copyfile(path, tmp / path.name)
        elif kind == "unpack":
            unpack(paths[0], tmp, entry)
        elif kind == "mrpc":
            prepare_glue.mrpc_from_senteval(*paths, tmp)
        elif kind == "cnndm":
            prepare_cnndm.from_parquet(paths, tmp)
        else:
            raise FetchError(f"unknown way to make {dest}: {kind!r}")
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_parent:
            with contextlib.suppress(OSError):
                dest.parent.rmdir()
        raise
    say(f"{dest} made from {', '.join(p.name for p in paths)}")


def unpack(archive, into, entry):
    """The archive's files into ``into``, without their common top folder (``roberta.base/``,
    ``RTE/``); a corrupt archive is an error that names it and its source."""
    source = ", ".join(entry["files"][0]["urls"][:1])
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
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise FetchError(f"{archive} (from {source}) cannot be extracted: {e}. No checksum "
                         "checked it: delete it and run again, or fetch it by hand") from None


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
    except ValueError as e:
        p.error(str(e))
    except FetchError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
