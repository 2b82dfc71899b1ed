"""What every part of the downloader shares: its errors, its messages, the environment's
numbers, folders and the lock that makes two runs take turns."""

import contextlib
import errno
import math
import os
import stat
import sys
import urllib.parse
from pathlib import Path

from filelock import FileLock, Timeout
from tqdm import tqdm

CHUNK = 1 << 20
# what a write that fails for want of room or rights means, and what to do about it
WRITE_ERRORS = {errno.ENOSPC: ("the disk is full", "free space"),
                errno.EDQUOT: ("the disk quota is exceeded", "free space within your quota"),
                errno.EROFS: ("the file system is read-only", "make it writable")}


# the user:password parts of the URLs this run was given (hide_credentials()), masked in
# every message whatever they hold
_credentials = set()


def credentials(url):
    """The user information of ``url`` (``user:password``, before the last ``@`` of its
    authority), as urllib.parse.urlsplit splits a URL; "" where it has none. A URL that
    urlsplit refuses (``http://u:p@[::1``) is split as it would split it."""
    try:
        netloc = urllib.parse.urlsplit(url).netloc
    except ValueError:
        netloc = url.partition("://")[2]
        for end in "/?#":
            netloc = netloc.partition(end)[0]
    return netloc.rpartition("@")[0]


def hide_credentials(url):
    """Mask the credentials of ``url`` in every message from now on, as written and as
    Python's repr() writes them."""
    secret = credentials(str(url))
    if secret:
        _credentials.update({secret, repr(secret)[1:-1]})


def _urls_in(text):
    """Each word of ``text`` that holds ``://``, from its scheme on."""
    for word in text.split():
        begin = word.find("://")
        while begin > 0 and (word[begin - 1].isalnum() or word[begin - 1] in "+-."):
            begin -= 1
        if begin >= 0:
            yield word[begin:]


def mask(text):
    """``text`` with the credentials of every URL in it masked (``https://***@host/...``):
    those of the URLs given to hide_credentials(), whatever they hold (a space, an ``@``),
    and those of any other URL in it (a redirect's), a word from its scheme on."""
    text = str(text)
    found = {credentials(url) for url in _urls_in(text)}
    for secret in sorted(_credentials | found, key=len, reverse=True):
        if secret:
            text = text.replace(secret + "@", "***@")
    return text


class FetchError(Exception):
    """A file that could not be fetched or verified; the message says why and what to do.
    ``missing``: where a missing file comes from and how to fetch it by hand (offline).
    URLs' credentials are masked in both."""

    def __init__(self, text, missing=None):
        super().__init__(mask(text))
        self.missing = None if missing is None else mask(missing)


class NoNetwork(FetchError):
    """No URL of a file could be reached: the message names what is missing, as OFFLINE=1."""


class Offline(FetchError):
    """OFFLINE=1 (or HF_HUB_OFFLINE=1 for a hub file) and the file is missing."""


class BadInput(ValueError):
    """An argument refused before anything is fetched (URLs' credentials masked)."""

    def __init__(self, text):
        super().__init__(mask(text))


def say(message):
    print(f"[fetch] {mask(message)}", file=sys.stderr, flush=True)


def human(n):
    return tqdm.format_sizeof(n, "B", 1000)


def offline():
    return os.environ.get("OFFLINE") == "1"


def positive(value, name):
    """``value`` as a number of seconds above 0, or BadInput naming ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise BadInput(f"{name} must be a number of seconds above 0, not {value!r}")
    return number


def seconds(name, default):
    """The number of seconds the environment variable ``name`` gives (default ``default``)."""
    value = os.environ.get(name, "").strip()
    return positive(value, name) if value else default


def is_hex(value, digits):
    """Whether ``value`` is ``digits`` lower-case hex digits (a digest, a commit id)."""
    return len(value) == digits and all(c in "0123456789abcdef" for c in value)


# what an --out is, when it is there and no regular file
SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
           (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path):
    """What ``path`` is where it is there and is neither a regular file nor a folder (a
    FIFO, a device such as /dev/null, a socket), else None: a download must not replace it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((what for test, what in SPECIAL if test(mode)), None)


def size_of(path):
    return path.stat().st_size if path.exists() else 0


def write_error(e, where):
    """One line for an OSError while writing ``where``: a full disk, quota or read-only file
    system says what to free; other errors (no rights, a missing folder) say where."""
    if e.errno in WRITE_ERRORS:
        what, remedy = WRITE_ERRORS[e.errno]
        return f"{what} ({e.filename or where}): {remedy} and run again"
    return (f"cannot write {e.filename or where} ({e.strerror or e}): give a place you can "
            "write to")


# ------------------------------------------------------------------------ folders, locks


def locked(path):
    """The lock ``.NAME.lock`` beside ``path`` (filelock), held: two runs take turns.
    BadInput where the lock file cannot be made (a folder without write rights, a
    read-only file system, /proc): filelock would take that for a lock held elsewhere."""
    name = path.with_name(f".{path.name}.lock")
    try:
        os.close(os.open(name, os.O_RDWR | os.O_CREAT, 0o644))
        lock = FileLock(str(name))
        try:
            return lock.acquire(timeout=0)
        except Timeout:
            say(f"waiting for another run fetching or making {path}")
            return lock.acquire()
    except OSError as e:
        raise BadInput(write_error(OSError(e.errno, e.strerror), path.parent)) from None


def make_folder(folder):
    """``folder`` and its missing parents; returns those made (to remove if left empty).
    BadInput where a path on the way is a file, or a folder cannot be made."""
    folder = Path(folder)
    for parent in [folder, *folder.parents]:
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{parent} is a file, not a folder")
    made = [d for d in [folder, *folder.parents] if not d.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot make the folder {folder} ({e.strerror or e}): give a place "
                       "you can write to") from None
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
