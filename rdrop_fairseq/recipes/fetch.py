#!/usr/bin/env python
"""Download the recipes' inputs: pinned, verified, resumed after a cut, with progress.

    python -m rdrop_fairseq.recipes.fetch [--sha256 HEX | --md5 HEX | --sha1 HEX] [--record] \\
        --out FILE URL [URL ...]
    python -m rdrop_fairseq.recipes.fetch --dir DOWNLOADS [--record] NAME[=DEST] ...
    python -m rdrop_fairseq.recipes.fetch --list          # the source table, as docs/data.md prints it

The first form fetches one file from the first URL that serves it. The second fetches the
files of the named sources of the source table (``sources.json`` beside this file, or the
JSON file that ``RDROP_SOURCES`` names) into DOWNLOADS, and with ``=DEST`` makes DEST from
them with the maker that the table names (``copy``, ``unpack``, or ``module:function``).
The recipe scripts' ``prepare`` stages run it.

Every file of the table is pinned: its SHA-256 (or the MD5 or SHA-1 a record gives) and
size from a public record, or, where no public record exists (fairseq's model tarballs), a
``no_public_record`` field that says so, and then the file is checked for being whole: its
size as served, and an archive read to its end. Files on the Hugging Face hub are fetched
like the others, from the hub's address for the file at a pinned commit; one without a
public record is checked against the SHA-256 that the hub publishes for it there, and a
copy already in the Hugging Face cache at that commit is used first, without the network.
Nothing appears under FILE unless verified; a download that fails verification is kept as
``FILE.bad``, never resumed from. ``--record`` pins a file that has no public record: the
SHA-256 of its first download is written to ``FILE.sha256`` and checked on later runs
(without ``--record`` nothing is pinned after the fact).

How a file is fetched (requests and urllib3, the hub's files too):

* with a User-Agent of its own, through the proxy that ``http_proxy`` / ``https_proxy``
  name, except for the hosts of ``no_proxy``; as served (a ``.tar.gz`` sent with
  ``Content-Encoding: gzip`` is not unpacked);
* each try waits ``RDROP_FETCH_CONNECT_TIMEOUT`` seconds (default 10) to connect and
  ``RDROP_FETCH_READ_TIMEOUT`` (default 30; ``--timeout``) for data; 5xx and 429 answers,
  time-outs and temporary name-lookup failures are tried again by urllib3's Retry, with
  back-off (a 429's or 503's ``Retry-After`` is honoured), ``--retries`` tries in all,
  then the next URL;
* into ``FILE.partial``, resumed with a Range request and ``If-Range`` (the partial file's
  ETag or Last-Modified; a hub file, at a commit, without): a file that changed meanwhile
  is fetched afresh, never spliced;
  a download cut after some bytes resumes at once; Ctrl-C and a full disk keep the
  partial file for the next run;
* 403, 404 and other refusals move to the next URL at once; so does a host that cannot be
  reached (refused, no route, a name that does not exist). When no URL of a file can be
  reached, its hosts are not waited for again in the run: without network the error names
  every missing file, where it comes from and how to fetch it by hand, as ``OFFLINE=1``
  does, within seconds;
* an HTML page where a file was expected is refused (a login or quota page served with 200);
* a FILE already there and verified is not fetched again; two runs fetching one file, or
  making one DEST, take turns (a lock file ``.NAME.lock`` beside it).

Making DEST never condemns a download: after a failure (a full disk while unpacking, say)
the verified files stay, and the next run makes DEST from them without fetching again.

Environment: ``OFFLINE=1`` fetches nothing: it names each missing file, where it comes
from and the command that fetches it by hand. ``DRY_RUN=1`` prints each URL and
destination. ``RDROP_SOURCES=table.json`` replaces the source table. ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` are huggingface_hub's. Exit status 0 only when every file asked for is
there, verified.
"""

import argparse
import contextlib
import errno
import hashlib
import importlib
import json
import os
import shlex
import shutil
import socket
import sys
import tarfile
import urllib.parse
import zipfile
from pathlib import Path

import requests
import urllib3
from filelock import FileLock, Timeout
from tqdm import tqdm
from urllib3.exceptions import (ConnectTimeoutError, MaxRetryError, NameResolutionError,
                                NewConnectionError, ProxyError)
from urllib3.util.retry import Retry

from .common import ArgumentParser, dry_run

TABLE = Path(__file__).with_name("sources.json")
USER_AGENT = "rdrop-fairseq-fetch/1.0 (+https://pypi.org/project/rdrop-fairseq/)"
HUB = "https://huggingface.co"
CHUNK = 1 << 20
DIGESTS = {"sha256": 64, "md5": 32, "sha1": 40}


class FetchError(Exception):
    """A file that could not be fetched or verified; the message says why and what to do.
    ``missing``: where a missing file comes from and how to fetch it by hand (offline)."""

    def __init__(self, text, missing=None):
        super().__init__(text)
        self.missing = missing


class NoNetwork(FetchError):
    """No URL of a file could be reached: the message names what is missing, as OFFLINE=1."""


class Offline(FetchError):
    """OFFLINE=1 (or HF_HUB_OFFLINE=1 for a hub file) and the file is missing."""


class BadInput(ValueError):
    """An argument refused before anything is fetched."""


# the hosts that could not be reached in this run, and why: a file all of whose hosts are
# among them is named as missing at once (as offline), without waiting for them again
_unreachable = {}


def offline():
    return os.environ.get("OFFLINE") == "1"


def say(message):
    print(f"[fetch] {message}", file=sys.stderr, flush=True)


def human(n):
    return tqdm.format_sizeof(n, "B", 1000)


def seconds(name, default):
    """The number of seconds the environment variable ``name`` gives (default ``default``)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0:
        raise BadInput(f"{name} must be a number of seconds above 0, not {value!r}")
    return number


# ------------------------------------------------------------------------ checksums


def file_digest(path, algorithm):
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def is_hex(value, digits):
    """Whether ``value`` is ``digits`` lower-case hex digits (a digest, a commit id)."""
    return len(value) == digits and all(c in "0123456789abcdef" for c in value)


def check_digest(algorithm, value, where=None):
    """``(algorithm, lower-case hex)``, or BadInput saying what is wrong (``where``: the file
    the value was read from; default: the option)."""
    if algorithm not in DIGESTS:
        raise BadInput(f"unknown checksum {algorithm!r}: give {', '.join(DIGESTS)}")
    value = value.strip().lower()
    if not is_hex(value, DIGESTS[algorithm]):
        raise BadInput(f"{where or '--' + algorithm} must hold {DIGESTS[algorithm]} hex "
                       f"digits, not {value!r}")
    return algorithm, value


def record_path(out):
    return out.with_name(out.name + ".sha256")


def recorded(out):
    """The SHA-256 recorded with ``--record`` at the first download of ``out``, if any."""
    path = record_path(out)
    if path.is_file():
        fields = path.read_text().split()
        if fields:
            return check_digest("sha256", fields[0], where=f"the recorded checksum {path}")
    return None


def record_first_seen(out):
    """Record the SHA-256 of ``out`` beside it (``--record``: later runs check it)."""
    if record_path(out).is_file():
        return
    digest = file_digest(out, "sha256")
    tmp = record_path(out).with_suffix(".tmp")
    tmp.write_text(f"{digest}  {out.name}\n")
    os.replace(tmp, record_path(out))
    say(f"{out.name}: no public checksum; first seen sha256 {digest} "
        f"(recorded in {record_path(out)}, checked on later runs)")


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


# ------------------------------------------------------------------------ folders, locks


def locked(path):
    """The lock ``.NAME.lock`` beside ``path`` (filelock), held: two runs take turns."""
    lock = FileLock(str(path.with_name(f".{path.name}.lock")))
    try:
        return lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another run fetching or making {path}")
        return lock.acquire()


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


def remove_made(made, *lock_of):
    """The folders this run made, where nothing but its lock files is in them."""
    if not made:
        return
    for path in lock_of:
        with contextlib.suppress(OSError):
            if [p.name for p in path.parent.iterdir()] == [f".{path.name}.lock"]:
                path.with_name(f".{path.name}.lock").unlink()
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


# ------------------------------------------------------------------------ HTTP


class _Answer(Exception):
    """Why a URL did not serve the file; ``cut``: after some bytes (resumed at once);
    ``unreachable``: why no connection was made to ``host`` (host:port)."""

    def __init__(self, text, cut=False, unreachable=None, host=None):
        super().__init__(text)
        self.cut, self.unreachable, self.host = cut, unreachable, host


class _Retry(Retry):
    """urllib3's Retry, but a refusal, no route or a name that does not exist (not a
    temporary look-up failure) is not tried again."""

    def increment(self, method=None, url=None, *args, error=None, **kwargs):
        cause = getattr(error, "original_error", error)  # through a proxy
        if isinstance(cause, NewConnectionError) and getattr(
                cause.__cause__, "errno", None) != socket.EAI_AGAIN:
            raise MaxRetryError(kwargs.get("_pool"), url, error)
        return super().increment(method, url, *args, error=error, **kwargs)


def _open(url, retry, timeouts, method="GET", **kwargs):
    """requests' answer once urllib3's ``retry`` has done what it may (5xx, 429 and its
    Retry-After, time-outs); _Answer when there is none."""
    session = requests.Session()
    session.headers.update({"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    for prefix in ("http://", "https://"):
        session.mount(prefix, requests.adapters.HTTPAdapter(max_retries=retry))
    try:
        return session.request(method, url, timeout=timeouts, **kwargs)
    except requests.RequestException as e:
        why = getattr(e.args[0] if e.args else None, "reason", e)
        if not isinstance(why, (ConnectTimeoutError, ProxyError)):
            raise _Answer(f"no answer ({why})") from None
        text = f"within {timeouts[0]:g} s" if type(why) is ConnectTimeoutError else why
        host = urllib.parse.urlsplit(getattr(e.request, "url", None) or url).netloc
        raise _Answer(f"no connection ({text})", unreachable=why, host=host) from None


class _Log:
    """Where tqdm writes in a log: a line of its own each time, not one rewritten."""

    def write(self, text):
        return text.strip() and say(text.strip())

    def flush(self):
        pass


def _bar(name, total, have):
    """tqdm's bar on a terminal; in a log, a line at every tenth of the file."""
    log = {} if sys.stderr.isatty() else dict(
        file=_Log(), mininterval=0, miniters=max((total or 10 ** 9) // 10, 1),
        bar_format="{desc}: " + ("{percentage:.0f} % ({n_fmt}B of {total_fmt}B, {rate_fmt}, "
                                 "{remaining} left)" if total else "{n_fmt}B ({rate_fmt})"))
    return tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1000,
                desc=name, **{"file": sys.stderr, **log})


def _size(path):
    return path.stat().st_size if path.exists() else 0


def _restart(partial):
    partial.unlink(missing_ok=True)
    partial.with_name(partial.name + ".validator").unlink(missing_ok=True)


def _download(url, partial, name, retry, timeouts, unverifiable, pinned=False):
    """``url`` into ``partial``, resumed with Range and If-Range (the ETag or Last-Modified
    of its first answer): a file that changed meanwhile, or a server that ignores Range,
    sends the whole file, which starts afresh. ``pinned``: a file that cannot change (the
    hub's, at a commit; checked by its SHA-256 after), resumed without If-Range, whose
    storage's validators may differ from answer to answer. Returns ``partial`` whole and
    the headers of every answer (redirects first), else _Answer. ``unverifiable``: nothing
    will check the file, so a body whose end cannot be told from a cut is refused."""
    have, validator = _size(partial), partial.with_name(partial.name + ".validator")
    headers = {"Range": f"bytes={have}-", "If-Range": validator.read_text()
               if validator.is_file() and not pinned else None}
    with _open(url, retry, timeouts, headers=headers if have else {}, stream=True) as resp:
        chain = [r.headers for r in (*resp.history, resp)]
        rng = resp.headers.get("Content-Range", "")
        if have and resp.status_code in (206, 416) and not rng.startswith(f"bytes {have}-"):
            if rng.endswith(f"/{have}"):
                return partial, chain  # whole already (a run killed after it)
            _restart(partial)  # another range: afresh
            return _download(url, partial, name, retry, timeouts, unverifiable, pinned)
        if resp.status_code >= 400:
            raise _Answer(f"{resp.status_code} {resp.reason}")
        if resp.status_code != 206:
            if have:
                say(f"{name}: the file changed, or the server ignores Range: starting afresh")
            _restart(partial)
            have, etag = 0, resp.headers.get("ETag", "W/")  # a weak ETag is not for If-Range
            if etag[:2] != "W/" or "Last-Modified" in resp.headers:
                validator.write_text(etag if etag[:2] != "W/" else resp.headers["Last-Modified"])
        length = resp.headers.get("Content-Length", "")
        total = have + int(length) if length.isdigit() else None
        if total is None and unverifiable and "chunked" not in resp.headers.get(
                "Transfer-Encoding", ""):
            raise _Answer("no Content-Length, and no checksum to tell the whole file from a "
                          "cut one")
        ctype = resp.headers.get("Content-Type", "")
        html = not name.endswith((".html", ".htm"))  # a login or quota page is not the file
        # unbuffered: what write() returned is on disk (a full disk loses nothing)
        with open(partial, "ab", buffering=0) as f, _bar(name, total, have) as bar:
            try:  # as served: a .tar.gz sent with Content-Encoding: gzip stays gzipped
                for block in iter(lambda: resp.raw.read1(CHUNK, decode_content=False), b""):
                    if html and bar.n == 0 and (ctype.startswith("text/html") or block.lstrip()[
                            :15].lower().startswith((b"<!doctype html", b"<html"))):
                        raise _Answer("an HTML page, not the file")
                    view = memoryview(block)
                    while view:
                        view = view[f.write(view):]
                    bar.update(len(block))
            except urllib3.exceptions.HTTPError as e:  # a cut, a stall
                raise _Answer(f"cut after {human(bar.n)} ({e})", cut=True) from None
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise FetchError(f"the disk is full: {partial} holds {human(_size(partial))} so "
                                 "far; free space and run again: the download resumes from "
                                 "there") from None
        return partial, chain


def _hub_cached(hub):
    """``hub``'s file in the Hugging Face cache at the pinned commit (downloaded before by
    huggingface_hub), or None: used without the network, offline too."""
    try:
        from huggingface_hub import try_to_load_from_cache
        path = try_to_load_from_cache(hub["repo"], hub["path"], revision=hub["revision"],
                                      repo_type=hub.get("type"))
    except (ImportError, ValueError):  # not installed; a repo id it refuses (then a 404)
        return None
    return Path(path) if isinstance(path, str) else None


def _published(chain):
    """The SHA-256 the hub publishes for a file it keeps in git LFS, as ``("sha256", hex)``,
    from the headers of its answers: the X-Linked-Etag of one (a redirect to its storage),
    or the ETag of a single answer (the file served itself); None for a file kept in git
    (its ETag is a git blob id)."""
    tags = [h.get("X-Linked-Etag") for h in chain] + [chain[0].get("ETag")] * (len(chain) == 1)
    tag = next((t for t in tags if t), "").strip('"')
    return ("sha256", tag) if is_hex(tag, 64) else None


def _from_urls(urls, out, partial, expected, size, tries, backoff, timeout, hub):
    """``out`` from the first of ``urls`` that serves it (a Path: a copy in the Hugging Face
    cache; ``hub``: a file on the hub), verified; returns ``[(url, _Answer)]``: why each URL
    failed (empty: ``out`` is there)."""
    timeouts = (seconds("RDROP_FETCH_CONNECT_TIMEOUT", 10.0),
                timeout or seconds("RDROP_FETCH_READ_TIMEOUT", 30.0))
    tried = []
    for url in urls:
        # once a host's name did not resolve, the others' connections are tried once
        lookups = not any(isinstance(a.unreachable, NameResolutionError) for _, a in tried)
        retry = _Retry(total=tries - 1, connect=None if lookups else 0, backoff_factor=backoff,
                       status_forcelist=(429, 500, 502, 503, 504), raise_on_status=False)
        answer, before = None, 0
        while answer is None or answer.cut and _size(partial) > before:
            before = _size(partial)
            say(f"{out.name}: from {url}" + (f" (resuming at {human(before)})" if before else ""))
            try:
                if isinstance(url, Path):  # the cache's file links to a blob named by SHA-256
                    path = Path(shutil.copyfile(url, partial))
                    chain = [{"ETag": Path(os.path.realpath(url)).name}]
                elif (host := urllib.parse.urlsplit(url).netloc) in _unreachable:
                    raise _Answer(f"not tried ({_unreachable[host]} earlier in this run)",
                                  unreachable=True, host=host)
                else:
                    path, chain = _download(url, partial, out.name, retry, timeouts,
                                            expected is None and size is None, bool(hub))
            except _Answer as e:
                say(f"{out.name}: {e}")
                answer = e
                if e.unreachable is not None and e.host:  # not waited for again in this run
                    _unreachable.setdefault(e.host, f"{url}: {e}")
                continue
            # without a public record, a hub file is checked against the hub's own SHA-256
            published = _published(chain) if hub else None
            problem, bad = _verify(path, expected or published, size, url, out.name), \
                out.with_name(out.name + ".bad")
            if published and not expected and not problem:
                say(f"{out.name}: sha256 verified as the hub publishes it at revision "
                    f"{hub['revision'][:12]}")
            os.replace(path, bad if problem else out)
            _restart(partial)
            if not problem:
                return []
            answer = _Answer(f"{problem} (kept as {bad})")
        tried.append((url, answer))
    return tried


# ------------------------------------------------------------------------ the hub


def hub_url(hub, path, endpoint=None):
    kind = {"dataset": "datasets/", "space": "spaces/"}.get(hub.get("type", "model"), "")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")
    return f"{endpoint}/{kind}{hub['repo']}/resolve/{hub['revision']}/{path}"


# ------------------------------------------------------------------------ one file


def fetch(urls, out, *, sha256=None, md5=None, sha1=None, size=None, timeout=None, retries=3,
          backoff=0.5, local_hint=None, record=False, hub=None):
    """Fetch ``out`` from the first of ``urls`` that serves it (``hub``: from the Hugging
    Face hub, ``{"repo", "type", "revision", "path"}``; see the module's docstring);
    returns ``out``. FetchError says why not (NoNetwork: no URL could be reached);
    BadInput is bad input, refused before anything is fetched. ``local_hint``: how to pass
    a local copy instead. ``record``: pin a file that has no checksum by its first
    download's SHA-256 (``--record``)."""
    out = Path(out)
    urls = [hub_url(hub, hub["path"])] if hub else list(urls)
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"{url!r} is not an http(s) URL")
    if out.is_dir():
        raise BadInput(f"{out} is a folder: give the file to write (--out FILE)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{parent} is a file, not a folder")
    given = {k: v for k, v in (("sha256", sha256), ("md5", md5), ("sha1", sha1)) if v}
    if len(given) > 1:
        raise BadInput("give one checksum: --sha256, --md5 or --sha1")
    expected = check_digest(*given.popitem()) if given else recorded(out)
    if retries < 1:
        raise BadInput(f"--retries must be 1 or more, not {retries}")
    seconds("RDROP_FETCH_CONNECT_TIMEOUT", 10.0)  # a bad value: refused before anything
    seconds("RDROP_FETCH_READ_TIMEOUT", 30.0)
    if dry_run():  # no hashing either: a dry run reads nothing
        mirrors = f" (mirrors: {' '.join(urls[1:])})" if len(urls) > 1 else ""
        there = " (there already)" if out.is_file() else ""
        print(f"++ fetch {urls[0] if urls else '(no URL)'} -> {out}{there}{mirrors}",
              flush=True)
        return out
    if out.is_file():
        return _there_already(out, expected, size, record)
    by_hand = manual_command(urls, out, expected)
    missing = f"{out} is missing: it comes from {' or '.join(urls)}; fetch it by hand: {by_hand}"
    cached = _hub_cached(hub) if hub else None  # used first, offline too
    hub_offline = hub and os.environ.get("HF_HUB_OFFLINE", "").upper() in (
        "1", "ON", "YES", "TRUE")
    if (offline() or hub_offline) and not cached:
        raise Offline(f"{'OFFLINE' if offline() else 'HF_HUB_OFFLINE'}=1 and {missing}", missing)
    if not (urls or cached):
        raise FetchError(f"no URL for {out}")
    if not cached and all(urllib.parse.urlsplit(u).netloc in _unreachable for u in urls):
        why = _unreachable[urllib.parse.urlsplit(urls[-1]).netloc]
        raise NoNetwork(f"no network ({why}): {missing}", missing)
    if offline() or hub_offline:
        urls = [cached]  # the cache's copy only
    elif cached:
        urls = [cached, *urls]
    partial, bad = out.with_name(out.name + ".partial"), out.with_name(out.name + ".bad")
    made, tried = make_folder(out.parent), []
    try:
        with locked(out):
            if out.is_file():  # fetched by the run we waited for
                return _there_already(out, expected, size, record)
            tried = _from_urls(urls, out, partial, expected, size, retries, backoff, timeout,
                               hub)
            if not tried:
                bad.unlink(missing_ok=True)
                if expected is None and record:
                    record_first_seen(out)
                say(f"{out} fetched" + (f", {expected[0]} verified" if expected else ""))
                return out
    except KeyboardInterrupt:
        if _size(partial):
            say(f"interrupted: {partial} keeps {human(_size(partial))}; run again to resume")
        raise
    finally:
        if not _size(partial):
            _restart(partial)
        if not out.is_file():
            remove_made(made, out)  # only where empty: nothing else is left behind
    reasons = "; ".join(f"{url}: {answer}" for url, answer in tried)
    hint = f", or {local_hint}" if local_hint else ""
    if all(answer.unreachable is not None for _, answer in tried):
        raise NoNetwork(f"cannot fetch {out.name}: {reasons}. No host could be reached; as "
                        f"with OFFLINE=1: {missing}{hint}", missing)
    raise FetchError(f"cannot fetch {out.name}: {reasons}. Fetch it by hand ({by_hand}){hint}")


def _there_already(out, expected, size, record):
    if size is not None and out.stat().st_size != size:
        raise FetchError(f"{out} is there already, but it holds {out.stat().st_size} bytes, "
                         f"not {size}: it is another file; move it away and run again")
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


def manual_command(urls, out, expected=None):
    """The command line that fetches ``out`` by hand."""
    cmd = [sys.executable, "-m", "rdrop_fairseq.recipes.fetch"]
    if expected:
        cmd += [f"--{expected[0]}", expected[1]]
    return shlex.join(cmd + ["--out", str(out), *urls])


# ------------------------------------------------------------------------ the table


def load_sources(path=None):
    """The source table: ``{name: entry}`` (``RDROP_SOURCES`` replaces the packaged one).
    FetchError names an entry that is not pinned or not well formed, and what to add."""
    path = Path(path or os.environ.get("RDROP_SOURCES") or TABLE)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FetchError(f"cannot read the source table {path}: {e}") from None
    table = {k: v for k, v in table.items() if not k.startswith("_")}
    seen = {}
    for name, entry in table.items():
        hub = entry.get("hub")
        if hub and not (hub.get("repo") and hub.get("revision")):
            raise FetchError(f"{path}: {name}'s hub needs a repo and a revision")
        if hub and not is_hex(hub["revision"], 40):  # a branch or tag moves: not pinned
            raise FetchError(f"{path}: {name}'s hub revision is {hub['revision']!r}: give the "
                             "commit id (40 hex digits) to fetch its files at")
        make = entry.get("make", "copy")
        if make not in ("copy", "unpack") and not all(make.partition(":")[::2]):
            raise FetchError(f"{path}: {name}'s make is {make!r}: give copy, unpack or "
                             "module:function")
        for f in entry.get("files", []):
            if f["name"] in seen:
                raise FetchError(f"{path}: {name} and {seen[f['name']]} both name {f['name']}")
            seen[f["name"]] = name
            if hub and (f.get("urls") or not f.get("path")):
                raise FetchError(f"{path}: {name}'s {f['name']} is on its hub: give its path "
                                 "in the repository, not urls")
            if not (hub or f.get("urls")):
                raise FetchError(f"{path}: {name}'s {f['name']} needs urls")
            if not ((_checksum_of(f) and f.get("size")) or f.get("no_public_record")):
                raise FetchError(f"{path}: {name}'s {f['name']} is not pinned: give its sha256 "
                                 "(or md5, sha1) and size, or say in no_public_record why none is "
                                 "known")
    return table


def _checksum_of(spec):
    for algorithm in DIGESTS:
        if spec.get(algorithm):
            return algorithm, spec[algorithm]
    return None


def _hub_of(entry, spec):
    return dict(entry["hub"], path=spec["path"]) if entry.get("hub") else None


def get(name, downloads, dest=None, table=None, record=False):
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
    paths, missing, first = [], [], None
    for spec in entry["files"]:
        out = downloads / spec["name"]
        check = _checksum_of(spec)
        try:
            fetch(spec.get("urls", []), out, size=spec.get("size"), record=record,
                  local_hint=entry.get("local"), hub=_hub_of(entry, spec),
                  **({check[0]: check[1]} if check else {}))
        except FetchError as e:
            if e.missing is None or not isinstance(e, (Offline, NoNetwork)):
                raise
            first = first or e
            missing.append(e.missing)
        paths.append(out)
    if missing:  # every missing file named, and where it comes from
        local = f" | or {entry['local']}" if entry.get("local") else ""
        if isinstance(first, NoNetwork):
            reasons = str(first).partition(" No host could be reached")[0]
            raise NoNetwork(f"{reasons} No host could be reached; as with OFFLINE=1: "
                            + " | ".join(missing) + local, " | ".join(missing))
        raise Offline(str(first).partition(" and ")[0] + ": " + " | ".join(missing) + local,
                      " | ".join(missing))  # OFFLINE=1 or HF_HUB_OFFLINE=1
    if dest is None:
        return paths
    if dry_run():
        print(f"++ make {dest} ({entry.get('make', 'copy')}) from "
              f"{', '.join(p.name for p in paths)}", flush=True)
        return dest
    make(entry.get("make", "copy"), paths, dest, entry)
    return dest


def _maker(kind):
    """The function that makes a folder from downloaded files: ``fn(paths, folder)``."""
    if kind == "copy":
        return lambda paths, folder: [shutil.copyfile(p, folder / p.name) for p in paths]
    if kind == "unpack":
        return lambda paths, folder: unpack(paths[0], folder)
    module, _, function = kind.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise FetchError(f"the source table's make {kind!r} cannot be loaded ({e}): give "
                         "copy, unpack or module:function") from None


def make(kind, paths, dest, entry):
    """DEST from the downloaded ``paths``, made whole in a sibling folder, then renamed.
    FetchError names the files and their source when they cannot be made into DEST; the
    downloads are left as they are (verified: the next run makes DEST from them)."""
    maker = _maker(kind)
    made = make_folder(dest.parent)
    source = ", ".join((f.get("urls") or [hub_url(entry["hub"], f.get("path", ""))])[0]
                       for f in entry["files"])
    try:
        with locked(dest):
            if dest.exists():  # made by the run we waited for
                return
            for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)  # a run killed while making DEST
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            tmp.mkdir()
            try:
                maker(paths, tmp)
                os.replace(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except FetchError:
        remove_made(made, dest)
        raise
    except Exception as e:  # the maker's own errors: a full disk, files it refuses
        remove_made(made, dest)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise FetchError(f"the disk is full while making {dest}: free space and run "
                             "again (the downloads are kept: nothing is fetched again)") from None
        names = ", ".join(str(p) for p in paths)
        raise FetchError(f"{names} (from {source}) cannot be made into {dest}: "
                         f"{e.__class__.__name__}: {e}") from None
    except BaseException:
        remove_made(made, dest)
        raise
    say(f"{dest} made from {', '.join(p.name for p in paths)}")


def unpack(archive, into):
    """The archive's files into ``into``, without their common top folder (``roberta.base/``,
    ``RTE/``); a corrupt archive is FetchError naming it."""
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
        raise FetchError(f"{archive} cannot be extracted: {e}") from None


def _common_top(names):
    """``"top/"`` when every name lies under one top folder, else ``""``."""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and all("/" in n for n in names):
        return tops.pop() + "/"
    return ""


def markdown_table(table=None):
    """The source table as docs/data.md prints it."""
    table = table if table is not None else load_sources()
    rows = ["| source | file | size | pinned by | licence | recipes |",
            "|---|---|---|---|---|---|"]
    for name, entry in table.items():
        if entry.get("manual"):
            rows.append(f"| {name} | no live source: {entry['manual']} | | | "
                        f"{entry.get('licence', '')} | {entry.get('used_by', '')} |")
            continue
        for spec in entry["files"]:
            check = _checksum_of(spec)
            pin = f"{check[0]} `{check[1][:12]}…`" if check else ""
            if spec.get("no_public_record"):
                pin = f"{pin}; no size on record" if check else "no public record: " + (
                    "the hub's sha256" if entry.get("hub") else "whole-file check")
            if entry.get("hub"):
                pin += f"; hub revision `{entry['hub']['revision'][:12]}`"
            size = human(spec["size"]) if spec.get("size") else "–"
            url = spec["urls"][0] if spec.get("urls") else hub_url(entry["hub"], spec["path"],
                                                                    HUB)
            rows.append(f"| {name} | [{spec['name']}]({url}) | {size} | {pin} | "
                        f"{entry.get('licence', '')} | {entry.get('used_by', '')} |")
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
    check.add_argument("--sha1", help="the file's SHA-1 (with --out)")
    p.add_argument("--record", action="store_true",
                   help="pin a file without a public checksum by the SHA-256 of its first "
                        "download (FILE.sha256, checked on later runs)")
    p.add_argument("--dir", type=Path, help="where the named sources' files go")
    p.add_argument("--list", action="store_true", help="print the source table (markdown)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds without data before a try counts as timed out (default: "
                        "RDROP_FETCH_READ_TIMEOUT, else 30)")
    p.add_argument("--retries", type=int, default=3,
                   help="tries per URL on 5xx, 429, time-outs and temporary name-lookup "
                        "failures (default 3); a download cut after some bytes resumes")
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
            fetch(a.items, a.out, sha256=a.sha256, md5=a.md5, sha1=a.sha1, timeout=a.timeout,
                  retries=a.retries, record=a.record)
            return
        if a.sha256 or a.md5 or a.sha1:
            p.error("--sha256/--md5/--sha1 go with --out; the table holds the sources' "
                    "checksums")
        table = load_sources()
        errors = []
        for item in a.items:
            name, _, dest = item.partition("=")
            try:
                get(name, a.dir, dest or None, table, record=a.record)
            except FetchError as e:
                if not isinstance(e, (Offline, NoNetwork)):
                    raise
                errors.append(str(e))  # no network: name every missing input, then fail
        if errors:
            raise FetchError("\n".join(errors))
    except BadInput as e:
        p.error(str(e))
    except FetchError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        sys.exit(f"error: the disk is full ({e.filename or e}): free space and run again")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
