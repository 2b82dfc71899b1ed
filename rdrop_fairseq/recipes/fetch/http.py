"""The downloader's HTTP layer: one requests Session for the run, ``download()`` of one URL
into a partial file (resumed where that cannot splice two versions of a file, decoded
where the server compressed what it was asked to send as is), and the progress bar. Each
way a URL can fail to serve the file is an exception: Cut (after some bytes: resume at
once), Refused (an answer that is not the file), Unreachable (no connection), Failed (the
rest)."""

import atexit
import codecs
import inspect
import itertools
import json
import os
import shutil
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass

import requests
import urllib3
from tqdm import tqdm
from urllib3.exceptions import ConnectTimeoutError, InvalidHeader, MaxRetryError, \
    NewConnectionError, ProxyError
from urllib3.util.retry import Retry

from .base import CHUNK, WRITE_ERRORS, FetchError, human, say, seconds, size_of

USER_AGENT = "rdrop-fairseq-fetch/1.0 (+https://pypi.org/project/rdrop-fairseq/)"
RETRY_AFTER_MAX = 120.0  # seconds, RDROP_FETCH_MAX_RETRY_AFTER: a longer wait is not waited
ANNOUNCE = 3.0  # a wait longer than this many seconds is said before it starts
SLOW_BYTES = 1024  # a try that brings fewer in --timeout seconds is ended


class Failed(Exception):
    """Why a URL did not serve the file."""


class Cut(Failed):
    """The answer ended before the file did: resumed at once."""


class Refused(Failed):
    """An answer that is not the file: an error status, an HTML page, a body without a length
    that nothing would check, a size other than the pinned one, a compression that cannot
    be told from the file's own or is not decoded here, a Retry-After longer than we wait."""


class Slow(Failed):
    """Less than SLOW_BYTES came in ``--timeout`` seconds (a trickle): the try is ended,
    tried again as a time-out is, the partial file kept."""


class Unreachable(Failed):
    """No connection to ``host`` (host:port); ``why``: urllib3's reason."""

    def __init__(self, text, host, why=None):
        super().__init__(text)
        self.host, self.why = host, why


class _TooLong(Exception):
    def __init__(self, after):
        super().__init__(after)
        self.after = after


_UNCLAMPED = {"retry_after_max": 10 ** 9} if "retry_after_max" in inspect.signature(
    Retry).parameters else {}


class _Retry(Retry):
    """urllib3's Retry, but a refusal, no route or a name that does not exist (not a
    temporary look-up failure) is not tried again, a Retry-After is waited for up to
    RDROP_FETCH_MAX_RETRY_AFTER seconds only, and a long wait is said."""

    def __init__(self, *args, **kwargs):  # recent urllib3 clamps it at 6 h; sleep() bounds it
        super().__init__(*args, **{**_UNCLAMPED, **kwargs})

    def increment(self, method=None, url=None, *args, error=None, **kwargs):
        cause = getattr(error, "original_error", error)  # through a proxy
        if isinstance(cause, NewConnectionError) and getattr(
                cause.__cause__, "errno", None) != socket.EAI_AGAIN:
            raise MaxRetryError(kwargs.get("_pool"), url, error)
        return super().increment(method, url, *args, error=error, **kwargs)

    def get_retry_after(self, response):
        """The Retry-After in seconds; None (the usual back-off) for one that is neither a
        number of seconds nor a date, which is said."""
        try:
            return super().get_retry_after(response)
        except InvalidHeader:
            say(f"the server's Retry-After {response.headers.get('Retry-After')!r} is neither "
                "a number of seconds nor a date: waiting as without one")
            return None

    def sleep(self, response=None):
        after = self.get_retry_after(response) if response is not None else None
        if after and after > seconds("RDROP_FETCH_MAX_RETRY_AFTER", RETRY_AFTER_MAX):
            raise _TooLong(after)
        wait = after or self.get_backoff_time()
        if wait > ANNOUNCE:
            say(f"waiting {wait:.0f} s before trying again"
                + (" (the server's Retry-After)" if after else ""))
        if wait > 0:
            time.sleep(wait)


def retry(tries, backoff, lookups=True):
    """How one URL is tried: ``tries`` in all on 5xx, 429, time-outs and temporary name
    look-up failures; connections tried once where ``lookups`` is False."""
    return _Retry(total=tries - 1, connect=None if lookups else 0, backoff_factor=backoff,
                  status_forcelist=(429, 500, 502, 503, 504), raise_on_status=False)


# ------------------------------------------------------------------------ the session

_session = None


def session(retries):
    """The run's one Session, made at its first request, its adapters set to ``retries``
    (read at each request; the downloader makes one at a time)."""
    global _session
    if _session is None:
        _session = requests.Session()
        _session.headers.update({"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    for adapter in _session.adapters.values():
        adapter.max_retries = retries
    return _session


@atexit.register
def close():
    """The end of a run: the Session and its connections closed."""
    global _session
    if _session is not None:
        _session.close()
        _session = None


def _when(after):
    at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + after))
    span = f"{after / 3600:.1f} h" if after >= 3600 else f"{after / 60:.0f} min" \
        if after >= 120 else f"{after:.0f} s"
    return f"in {span}, at {at}"


def _open(url, retries, timeouts, **kwargs):
    """requests' answer once urllib3's ``retries`` has done what it may; else Failed (Refused
    for a redirect that cannot be followed: a Location that is no URL, not UTF-8, a host
    name too long)."""
    try:
        return session(retries).get(url, timeout=timeouts, **kwargs)
    except _TooLong as e:
        cap = seconds("RDROP_FETCH_MAX_RETRY_AFTER", RETRY_AFTER_MAX)
        raise Refused(f"the server asks to be tried again {_when(e.after)}, later than "
                      f"RDROP_FETCH_MAX_RETRY_AFTER ({cap:g} s) waits: run again then") from None
    except (ValueError, urllib3.exceptions.HTTPError) as e:  # a Location that is no URL
        raise Refused(f"an answer that cannot be followed ({e.__class__.__name__}: "
                      f"{' '.join(str(e).split())[:120]})") from None
    except requests.RequestException as e:
        why = getattr(e.args[0] if e.args else None, "reason", e)
        if not isinstance(why, (ConnectTimeoutError, ProxyError)):
            raise Failed(f"no answer ({why})") from None
        text = f"within {timeouts[0]:g} s" if type(why) is ConnectTimeoutError else why
        host = urllib.parse.urlsplit(getattr(e.request, "url", None) or url).netloc
        raise Unreachable(f"no connection ({text})", host, why) from None


# ------------------------------------------------------------------------ one URL

# what _plan() answers besides the byte an answer's body begins at
WHOLE, AGAIN = "the partial file is whole", "ask for the whole file"
# a content-coding that names the file's own compression (servers label a .gz so): the
# body is the file, kept as served
OWN_CODING = {"gzip": (".gz", ".tgz"), "x-gzip": (".gz", ".tgz"), "compress": (".z",),
              "x-compress": (".z",), "br": (".br",), "zstd": (".zst",)}
DECODED = ("gzip", "x-gzip", "deflate")  # the codings decoded on the way
PAGE_TYPES = ("text/html", "application/xhtml+xml")


def _validator(partial):
    return partial.with_name(partial.name + ".validator")


def restart(partial):
    partial.unlink(missing_ok=True)
    _validator(partial).unlink(missing_ok=True)


def refuse_links(partial):
    """FetchError where ``partial`` or its validator file is a symbolic link: nothing is
    written through one (and both are opened with O_NOFOLLOW besides)."""
    for path in (partial, _validator(partial)):
        if path.is_symlink():
            raise FetchError(f"{path} is a symbolic link, not a download of ours: nothing is "
                             "written through it; remove it and run again")


def _recall(partial):
    """What _begin() kept beside ``partial``: ``{"url", "validator", "total"}``; ``{}`` for
    none, or one of another form (an older version's)."""
    try:
        with open(os.open(_validator(partial), os.O_RDONLY | os.O_NOFOLLOW),
                  encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _resume_point(partial, url, name, check, pinned, size):
    """Where ``partial`` resumes from ``url``, the If-Range to send, and the file's size as
    promised (the pinned ``size``, else the total of the answer that began ``partial``). Its
    validator counts only for the URL it came from: a mirror's file with the same date
    is another file. A file that cannot change (``pinned``: the hub's, at a commit) or
    whose result a checksum checks resumes without a validator; any other starts afresh
    without one: a file that changed meanwhile would be spliced, and nothing would see it
    (a size does not)."""
    have, record = size_of(partial), _recall(partial)
    if not have:
        return 0, None, size
    bound = record if record.get("url") == url else {}
    promised = size if size is not None else bound.get("total")
    if pinned or bound.get("validator"):
        return have, None if pinned else bound["validator"], promised
    if check != "digest":
        why = (f"the ETag or Last-Modified of {human(have)} came from {record['url']}, not this "
               "URL," if record.get("validator") and record.get("url") else
               f"no ETag or Last-Modified to resume {human(have)} against")
        say(f"{name}: {why} and no checksum to check the result: starting afresh")
        return 0, None, size
    return have, None, promised


def _coding(resp, name, check):
    """The content-coding to decode the body with, or None: kept as served (no coding, or
    one that names the file's own compression, which the checksum, or reading the tarball
    through, tells from a second compression). Refused for a coding not decoded here, and
    for a file's own compression that nothing will check."""
    coding = resp.headers.get("Content-Encoding", "").strip().lower()
    if coding in ("", "identity"):
        return None
    if name.lower().endswith(OWN_CODING.get(coding, ())):
        if check is None and not name.lower().endswith((".tar.gz", ".tgz")):
            raise Refused(f"Content-Encoding: {coding} on a file compressed that way itself, "
                          "with no checksum or size to check it: cannot tell whether the "
                          "server compressed it again; give its checksum")
        return None
    if coding not in DECODED:
        raise Refused(f"compressed on the way (Content-Encoding: {coding}), which is not "
                      f"decoded here: only {', '.join(DECODED)}")
    return coding


def _number(text):
    """``text`` as a number of bytes (ASCII digits: str.isdigit() also takes "²"), or None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _content_range(resp):
    """The answer's Content-Range as ``(first, last, total)``: ``bytes */TOTAL`` gives
    ``(None, None, TOTAL)``, an unknown total (``/*``) None; None where there is none.
    Refused for one that is not of these forms, or whose bytes do not lie in its total."""
    value = resp.headers.get("Content-Range")
    if value is None:
        return None
    unit, _, spec = value.strip().partition(" ")
    span, _, whole = spec.partition("/")
    total = None if whole == "*" else _number(whole)
    first, last = (None, None) if span == "*" else map(_number, span.partition("-")[::2])
    if unit != "bytes" or (whole != "*" and total is None) or (span == "*") != (
            first is None) or (span != "*" and (last is None or last < first or (
                total is not None and last >= total))) or (span == "*" and total is None):
        raise Refused(f"a Content-Range that is none: {value[:80]!r}")
    return first, last, total


def _unsatisfiable(name, have, rng, check, promised):
    """What a 416 to a resume means: WHOLE only where the total it gives is the size of
    ``partial`` and the size promised (or, none promised, a checksum will check); else
    AGAIN. Refused for a 416 to a request for the whole file."""
    total = rng[2] if rng else None
    if not have:
        raise Refused("416 Range Not Satisfiable, to a request without a Range")
    if total == have and (promised == have or (promised is None and check == "digest")):
        return WHOLE
    say(f"{name}: the server answers the resume at {have} bytes with 416 (the file's size "
        f"{total if total is not None else 'unsaid'}, {promised or 'none'} promised): asking "
        "for the whole file")
    return AGAIN


def _plan(resp, name, have, sent, check, promised):
    """How an answer is used: ``(start, coding)``, the byte of the file its body begins at
    (``have``: a resume; 0: the whole file) and the content-coding decoded on the way (None:
    as served); or WHOLE (``partial`` is the whole file already: a run killed after it) or
    AGAIN. Its framing is checked against the request and the first answer: a 200 only
    without a Content-Range that says it holds less than the whole file; a 206 only where
    it begins at the byte asked for (0 without a Range), carries the validator sent in
    If-Range and the total ``promised``, and is not compressed on the way (its ranges
    would count compressed bytes); a 416 as _unsatisfiable() says. Refused for any other
    status (a redirect not followed, a 304) and for what cannot be the file."""
    status, rng = resp.status_code, _content_range(resp)
    if status == 416:
        return _unsatisfiable(name, have, rng, check, promised), None
    if status not in (200, 206):
        raise Refused(f"{status} {resp.reason}" + ("" if status >= 400 else
                                                    ": an answer that is not the file"))
    coding = _coding(resp, name, check)
    if status == 200:
        if rng and (rng[0], rng[1] + 1) != (0, rng[2]):
            raise Refused(f"a 200 whose Content-Range says it holds bytes {rng[0]}-{rng[1]} "
                          f"of {rng[2] or 'an unsaid size'}: not the whole file")
        if have:
            say(f"{name}: the file changed, or the server ignores Range: starting afresh")
        return 0, coding
    if rng is None or rng[0] != have:
        where = f"bytes {rng[0]}-{rng[1]}" if rng and rng[0] is not None else "no range"
        if not have:
            raise Refused(f"a 206 that holds {where}, to a request for the whole file")
        say(f"{name}: the server's 206 holds {where}, not bytes {have}- as asked: asking for "
            "the whole file")
        return AGAIN, None
    if have and promised is not None and rng[2] != promised:
        say(f"{name}: the server's 206 gives the file's size as {rng[2]}, not the {promised} "
            "bytes first promised: asking for the whole file")
        return AGAIN, None
    if have and sent and sent not in (resp.headers.get("ETag"),
                                      resp.headers.get("Last-Modified")):
        say(f"{name}: the server's 206 does not carry the {sent} asked for (it ignores "
            "If-Range: the file may have changed): asking for the whole file")
        return AGAIN, None
    if have and coding:
        say(f"{name}: the server compresses its answer (Content-Encoding: {coding}), and its "
            "ranges count compressed bytes: asking for the whole file")
        return AGAIN, None
    return have, coding


def _total(resp, have):
    """The file's size as the answer promises it: a 206's Content-Range total, else
    ``have`` and the Content-Length; None where it says neither. Refused for a
    Content-Length that is no number."""
    rng = _content_range(resp)
    if resp.status_code == 206 and rng[2] is not None:
        return rng[2]
    length = resp.headers.get("Content-Length")
    if length is None:
        return None
    if _number(length) is None:
        raise Refused(f"a Content-Length that is no number: {length[:40]!r}")
    return have + _number(length)


def _announced(resp, start, coding, check, size):
    """The file's size as the answer announces it (None: it does not, or its length counts
    compressed bytes). Refused where it is not the pinned ``size``, and where nothing would
    tell the whole body from a cut one."""
    total = _total(resp, start)
    if total is None and check is None and "chunked" not in resp.headers.get(
            "Transfer-Encoding", ""):
        raise Refused("no Content-Length, and no checksum to tell the whole file from a "
                      "cut one")
    if coding:
        return None
    if size is not None and total is not None and total != size:
        raise Refused(f"the server announces {total} bytes, not the {size} pinned: another "
                      "file")
    return total


@dataclass
class _Body:
    """How an answer's body is received: ``url`` it answers, the file's ``name``, the byte
    ``start`` of the file it begins at, the file's ``total`` as announced, the ``coding``
    decoded, at most ``cap`` bytes (``capped``: in words, why), a try ended after
    ``slow`` seconds that bring less than SLOW_BYTES."""
    url: str
    name: str
    start: int
    total: int
    coding: str
    cap: int
    capped: str
    slow: float


def _cap(partial, total, start, size):
    """The most bytes an answer may add to ``partial``, and why: the rest of the size it
    announced (Content-Length, Content-Range), else of the pinned ``size``, else (no length,
    or one that counts compressed bytes) the free space on the disk as the answer begins."""
    if total is not None:
        return total - start, f"the {total} bytes announced"
    if size is not None:
        return size - start, f"the {size} bytes pinned"
    free = shutil.disk_usage(partial.parent).free
    return free, f"the free space on its disk ({human(free)})"


def download(url, partial, name, retries, timeouts, check=None, pinned=False, size=None):
    """``url`` into ``partial``, resumed with Range and If-Range (the ETag or Last-Modified
    of the answer from ``url`` that began it; see _resume_point and _plan): a file that
    changed meanwhile, a server that ignores Range or If-Range, or one that compresses its
    answers, gets the whole file asked for. ``partial`` is replaced only by an answer whose
    first block passed (a refused answer leaves it as it was), grows by no more than
    _cap() allows (past it, it is discarded: Refused), and a try that brings less than
    SLOW_BYTES in ``timeouts[1]`` seconds ends (Slow). Returns the headers of every answer
    (redirects first); raises Failed and its kinds, and FetchError for a ``partial`` that is
    a symbolic link or a disk that fills (_full_disk). ``check``: what will check the file, "digest", "size" or None (then a
    body whose end cannot be told from a cut is refused); ``pinned``: it cannot change;
    ``size``: its pinned size, compared with the answer's before the body is read."""
    refuse_links(partial)
    have, sent, promised = _resume_point(partial, url, name, check, pinned, size)
    while True:
        headers = {"Range": f"bytes={have}-", "If-Range": sent} if have else {}
        with _open(url, retries, timeouts, headers=headers, stream=True) as resp:
            chain = [r.headers for r in (*resp.history, resp)]
            start, coding = _plan(resp, name, have, sent, check, promised)
            if start == AGAIN:
                have, sent, promised = 0, None, size
                continue
            if start == WHOLE:
                return chain
            total = _announced(resp, start, coding, check, size)
            body = _Body(url, name, start, total, coding, *_cap(partial, total, start, size),
                         timeouts[1])
            try:
                got = _receive(resp, partial, body)
            except _Full as full:  # kept only where the rerun resumes (_resume_point)
                resumable = not coding and (pinned or check == "digest"
                                            or bool(_recall(partial).get("validator")))
                raise _full_disk(full, partial, body, resumable) from None
        if total is not None and got < total:  # a short answer (a proxy's cut) is a cut
            raise Cut(f"cut at {human(got)} of {human(total)} (the answer ended early)")
        return chain


# ------------------------------------------------------------------------ the body


def _is_html(resp, name, start):
    """A test of an answer's first block for an HTML page (a portal's login or quota page
    served with 200) where a file, not a page, is expected: by its Content-Type (in any
    case), and for an answer that begins the file, by how the block begins."""
    if name.lower().endswith((".html", ".htm", ".xhtml")):
        return lambda block: False
    if resp.headers.get("Content-Type", "").partition(";")[0].strip().lower() in PAGE_TYPES:
        return lambda block: True
    return _begins_html if start == 0 else (lambda block: False)


def _begins_html(block):
    """Whether ``block`` begins an HTML page: ``<!DOCTYPE html`` or ``<html``, after a UTF-8
    byte-order mark, white space, an XML declaration and comments."""
    head = block.removeprefix(codecs.BOM_UTF8).lstrip()
    while head.startswith((b"<?xml", b"<!--")):
        head = head.partition(b"?>" if head.startswith(b"<?") else b"-->")[2].lstrip()
    return head[:14].lower().startswith((b"<!doctype html", b"<html"))


def _begin(partial, resp, body):
    """``partial`` emptied for an answer that begins the file, and kept beside it for a
    later resume: the URL it came from, its validator for If-Range (its ETag, a weak one is
    not for If-Range, else its Last-Modified, else none) and the total it announced."""
    restart(partial)
    etag = resp.headers.get("ETag", "W/")
    record = {"url": body.url, "total": body.total,
              "validator": etag if etag[:2] != "W/" else resp.headers.get("Last-Modified")}
    with open(os.open(_validator(partial), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                      | os.O_NOFOLLOW, 0o644), "w", encoding="utf-8") as f:
        json.dump(record, f)


def _why(e):
    """urllib3's reason in words: a ProtocolError's message, not the tuple of its args."""
    return e.args[0] if len(e.args) > 1 and isinstance(e.args[0], str) else e


class _Over(Exception):
    """An answer that brings more than its cap."""


def _write(f, blocks, body, bar):
    """``blocks`` written whole to ``f`` (what write() returned is on disk: a full disk
    loses nothing); _Over before a block that would pass ``body.cap``, Slow where less
    than SLOW_BYTES came in ``body.slow`` seconds."""
    room, window, since = body.cap, time.monotonic(), 0
    for block in blocks:
        if len(block) > room:
            raise _Over()
        view = memoryview(block)
        while view:
            view = view[f.write(view):]
        room, since = room - len(block), since + len(block)
        bar.update(len(block))
        if time.monotonic() - window >= body.slow:
            if since < SLOW_BYTES:
                raise Slow(f"less than 1 KiB in {body.slow:g} s (a trickle; --timeout)")
            window, since = time.monotonic(), 0


def _receive(resp, partial, body):
    """The body into ``partial`` from byte ``body.start``, decoded where ``body.coding``
    says, else as served (a .tar.gz sent with Content-Encoding: gzip stays gzipped); an
    answer that begins the file replaces what ``partial`` held once its first block is no
    HTML page. Returns the size of ``partial`` after."""
    html = _is_html(resp, body.name, body.start)
    blocks = iter(lambda: resp.raw.read1(CHUNK, decode_content=bool(body.coding)), b"")
    with _bar(body.name, body.total, body.start) as bar:
        try:
            first = next(blocks, b"")
            if html(first):
                raise Refused("an HTML page, not the file")
            if body.start == 0:
                _begin(partial, resp, body)
            with open(os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                              0o644), "ab", buffering=0) as f:  # unbuffered: see _write
                _write(f, itertools.chain([first], blocks), body, bar)
        except _Over:
            restart(partial)
            raise Refused(f"more than {body.capped} came: {partial.name} discarded, not "
                          "resumed") from None
        except urllib3.exceptions.DecodeError:
            raise Refused(f"Content-Encoding: {body.coding}, but the body is no "
                          f"{body.coding} data") from None
        except urllib3.exceptions.HTTPError as e:  # a cut, a stall
            raise Cut(f"cut after {human(bar.n)} ({_why(e)})") from None
        except OSError as e:
            if e.errno not in WRITE_ERRORS:
                raise
            raise _Full(e.errno) from None
    return size_of(partial)


class _Full(Exception):
    """A write into the partial file failed for want of room (WRITE_ERRORS: ENOSPC, EDQUOT,
    EROFS); download() says whether a rerun resumes."""

    def __init__(self, errno_):
        super().__init__(errno_)
        self.errno = errno_


def _full_disk(full, partial, body, resumable):
    """The FetchError for a disk that filled (``full``, a _Full) while ``partial`` grew:
    kept where a rerun resumes from it, else removed (it only holds the room the rerun
    needs), and the line says which."""
    what, remedy = WRITE_ERRORS[full.errno]
    held = human(size_of(partial))
    if resumable:
        return FetchError(f"{what}: {partial} holds {held} so far; {remedy} and run again: "
                          "the download resumes from there")
    why = (f"it came compressed (Content-Encoding: {body.coding}) and the server's ranges "
           "count compressed bytes" if body.coding else
           "no ETag or Last-Modified and no checksum would make a resumed file safe")
    restart(partial)
    return FetchError(f"{what}: {body.name} cannot resume ({why}), so the {held} that came "
                      f"are removed from {partial.parent}; {remedy} and run again")


class _Log:
    """Where tqdm writes in a log: a line of its own each time, not one rewritten."""

    def write(self, text):
        return text.strip() and say(text.strip())

    def flush(self):
        pass


class _LogBar(tqdm):
    """tqdm's bar in a log: its last line said once (tqdm says it again as it closes)."""

    def close(self):
        if self.last_print_n == self.n:
            self.leave = False
        super().close()


def _bar(name, total, have):
    """tqdm's bar on a terminal; in a log, a line at every tenth of the file."""
    bar = dict(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1000,
               desc=name)
    if sys.stderr.isatty():
        return tqdm(**bar, file=sys.stderr)
    return _LogBar(**bar, file=_Log(), mininterval=0, miniters=max((total or 10 ** 9) // 10, 1),
                   bar_format="{desc}: " + ("{percentage:.0f} % ({n_fmt}B of {total_fmt}B, "
                                            "{rate_fmt}, {remaining} left)" if total
                                            else "{n_fmt}B ({rate_fmt})"))
