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
import socket
import sys
import time
import urllib.parse

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


class Failed(Exception):
    """Why a URL did not serve the file."""


class Cut(Failed):
    """The answer ended before the file did: resumed at once."""


class Refused(Failed):
    """An answer that is not the file: an error status, an HTML page, a body without a length
    that nothing would check, a size other than the pinned one, a compression that cannot
    be told from the file's own or is not decoded here, a Retry-After longer than we wait."""


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
    """requests' answer once urllib3's ``retries`` has done what it may; else Failed."""
    try:
        return session(retries).get(url, timeout=timeouts, **kwargs)
    except _TooLong as e:
        cap = seconds("RDROP_FETCH_MAX_RETRY_AFTER", RETRY_AFTER_MAX)
        raise Refused(f"the server asks to be tried again {_when(e.after)}, later than "
                      f"RDROP_FETCH_MAX_RETRY_AFTER ({cap:g} s) waits: run again then") from None
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


def _resume_point(partial, name, check, pinned):
    """Where ``partial`` resumes, and the If-Range to send. A file that cannot change
    (``pinned``: the hub's, at a commit) or whose result a checksum checks resumes without
    a validator; any other starts afresh without one: a file that changed meanwhile would
    be spliced, and nothing would see it (a size does not)."""
    have, validator = size_of(partial), _validator(partial)
    if not have or pinned:
        return have, None
    if validator.is_file():
        return have, validator.read_text()
    if check != "digest":
        say(f"{name}: no ETag or Last-Modified to resume {human(have)} against and no checksum "
            "to check the result: starting afresh")
        return 0, None
    return have, None


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


def _plan(resp, name, have, sent, check):
    """How an answer is used: ``(start, coding)``, the byte of the file its body begins at
    (``have``: a resume; 0: the whole file) and the content-coding decoded on the way (None:
    as served); or WHOLE (``partial`` is the whole file already: a run killed after it) or
    AGAIN. A 206 is a resume only where it answers the range asked for, carries the
    validator sent in If-Range, and is not compressed on the way (its ranges would count
    compressed bytes). Refused for an error status and what cannot be the file."""
    rng = resp.headers.get("Content-Range", "")
    if have and resp.status_code in (206, 416) and not rng.startswith(f"bytes {have}-"):
        return (WHOLE if rng.endswith(f"/{have}") else AGAIN), None  # another range
    if resp.status_code >= 400:
        raise Refused(f"{resp.status_code} {resp.reason}")
    coding = _coding(resp, name, check)
    if resp.status_code != 206 or not have:
        if have:
            say(f"{name}: the file changed, or the server ignores Range: starting afresh")
        return 0, coding
    if sent and sent not in (resp.headers.get("ETag"), resp.headers.get("Last-Modified")):
        say(f"{name}: the server's 206 does not carry the {sent} asked for (it ignores "
            "If-Range: the file may have changed): asking for the whole file")
        return AGAIN, None
    if coding:
        say(f"{name}: the server compresses its answer (Content-Encoding: {coding}), and its "
            "ranges count compressed bytes: asking for the whole file")
        return AGAIN, None
    return have, None


def _total(resp, have):
    """The file's size as the answer promises it: a 206's Content-Range total, else
    ``have`` and the Content-Length; None where it says neither."""
    whole = resp.headers.get("Content-Range", "").rpartition("/")[2]
    if resp.status_code == 206 and whole.isdigit():
        return int(whole)
    length = resp.headers.get("Content-Length", "")
    return have + int(length) if length.isdigit() else None


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


def download(url, partial, name, retries, timeouts, check=None, pinned=False, size=None):
    """``url`` into ``partial``, resumed with Range and If-Range (the ETag or Last-Modified
    of the answer that began it; see _resume_point and _plan): a file that changed
    meanwhile, a server that ignores Range or If-Range, or one that compresses its answers,
    gets the whole file asked for. ``partial`` is replaced only by an answer whose first
    block passed (a refused answer leaves it as it was). Returns the headers of every
    answer (redirects first); raises Failed and its kinds. ``check``: what will check the
    file, "digest", "size" or None (then a body whose end cannot be told from a cut is
    refused); ``pinned``: it cannot change; ``size``: its pinned size, compared with the
    answer's before the body is read."""
    have, sent = _resume_point(partial, name, check, pinned)
    while True:
        headers = {"Range": f"bytes={have}-", "If-Range": sent} if have else {}
        with _open(url, retries, timeouts, headers=headers, stream=True) as resp:
            chain = [r.headers for r in (*resp.history, resp)]
            start, coding = _plan(resp, name, have, sent, check)
            if start == AGAIN:
                have, sent = 0, None
                continue
            if start == WHOLE:
                return chain
            total = _announced(resp, start, coding, check, size)
            got = _receive(resp, partial, name, total, start, coding)
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


def _begin(partial, resp):
    """``partial`` emptied for an answer that begins the file, and that answer's validator
    kept for a later resume's If-Range: its ETag (a weak one is not for If-Range), else
    its Last-Modified."""
    restart(partial)
    etag = resp.headers.get("ETag", "W/")
    if etag[:2] != "W/" or "Last-Modified" in resp.headers:
        _validator(partial).write_text(etag if etag[:2] != "W/" else resp.headers["Last-Modified"])


def _why(e):
    """urllib3's reason in words: a ProtocolError's message, not the tuple of its args."""
    return e.args[0] if len(e.args) > 1 and isinstance(e.args[0], str) else e


def _receive(resp, partial, name, total, start, coding):
    """The body into ``partial`` from byte ``start``, decoded where ``coding`` says, else as
    served (a .tar.gz sent with Content-Encoding: gzip stays gzipped); an answer that
    begins the file replaces what ``partial`` held once its first block is no HTML page.
    Returns the size of ``partial`` after."""
    html = _is_html(resp, name, start)
    blocks = iter(lambda: resp.raw.read1(CHUNK, decode_content=bool(coding)), b"")
    with _bar(name, total, start) as bar:
        try:
            first = next(blocks, b"")
            if html(first):
                raise Refused("an HTML page, not the file")
            if start == 0:
                _begin(partial, resp)
            # unbuffered: what write() returned is on disk (a full disk loses nothing)
            with open(partial, "ab", buffering=0) as f:
                for block in itertools.chain([first], blocks):
                    view = memoryview(block)
                    while view:
                        view = view[f.write(view):]
                    bar.update(len(block))
        except urllib3.exceptions.DecodeError:
            raise Refused(f"Content-Encoding: {coding}, but the body is no {coding} data") \
                from None
        except urllib3.exceptions.HTTPError as e:  # a cut, a stall
            raise Cut(f"cut after {human(bar.n)} ({_why(e)})") from None
        except OSError as e:
            if e.errno not in WRITE_ERRORS:
                raise
            what, remedy = WRITE_ERRORS[e.errno]
            raise FetchError(f"{what}: {partial} holds {human(size_of(partial))} so far; "
                             f"{remedy} and run again: the download resumes from there") from None
    return size_of(partial)


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
