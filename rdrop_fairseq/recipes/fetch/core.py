"""What the downloader decides for one file and for a source of the table: which copies to
try and in what order (the Hugging Face cache first, then the URLs: the hub's, or a file's
mirrors), when to resume and when to move on, what offline and unreachable hosts mean, and
when a file counts as fetched."""

import os
import shlex
import shutil
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from urllib3.exceptions import NameResolutionError

from ..common import dry_run
from . import http
from .base import BadInput, FetchError, NoNetwork, Offline, hide_credentials, human, \
    locked, make_folder, mask, not_a_file, offline, positive, remove_made, say, seconds, size_of
from .table import hub_of, hub_url, load_sources, make
from .verify import cached_digest, check_digest, checksum_of, file_digest, published, \
    record_first_seen, recorded, verify

# the hosts (host:port) that could not be reached in this run, and why: a file all of whose
# hosts are among them is named as missing at once (as offline), without waiting again
_unreachable = {}


@dataclass
class _File:
    """One file to fetch, and how: what checks it, how each URL is tried."""
    out: Path
    urls: list
    expected: tuple = None
    size: int = None
    hub: dict = None
    tries: int = 3
    backoff: float = 0.5
    timeouts: tuple = (10.0, 30.0)

    @property
    def partial(self):
        return self.out.with_name(self.out.name + ".partial")

    @property
    def bad(self):
        return self.out.with_name(self.out.name + ".bad")

    @property
    def by_hand(self):
        """The command line that fetches the file by hand."""
        cmd = [sys.executable, "-m", "rdrop_fairseq.recipes.fetch"]
        if self.expected:
            cmd += [f"--{self.expected[0]}", self.expected[1]]
        return shlex.join(cmd + ["--out", str(self.out), *self.urls])

    @property
    def missing(self):
        return (f"{self.out} is missing: it comes from {' or '.join(self.urls)}; fetch it by "
                f"hand: {self.by_hand}")


def _host(url):
    return urllib.parse.urlsplit(url).netloc


# ------------------------------------------------------------------------ one copy


def _settle(file, path, expected):
    """The complete download ``path`` verified against ``expected`` and moved under the
    final name, or kept as ``.bad``: None, or why it is not the file."""
    problem = verify(path, expected, file.size, file.out.name)
    os.replace(path, file.bad if problem else file.out)
    http.restart(file.partial)
    if problem:
        return http.Refused(f"{problem} (kept as {file.bad})")
    if expected and not file.expected and file.hub:
        say(f"{file.out.name}: sha256 verified as the hub publishes it at revision "
            f"{file.hub['revision'][:12]}")
    return None


def _from_cache(file, cached):
    """The copy in the Hugging Face cache, checked by the table or, without a public record,
    by the SHA-256 its blob is named by: None, or why it is not the file."""
    say(f"{file.out.name}: from {cached}")
    shutil.copyfile(cached, file.partial)
    return _settle(file, file.partial, file.expected or cached_digest(cached))


def _from_url(file, url, retries):
    """The file from ``url``; a cut that brought bytes resumes at once, a trickle (Slow) is
    tried ``file.tries`` times in all: None, or why not."""
    slow = 0
    while True:
        before = size_of(file.partial)
        say(f"{file.out.name}: from {url}" + (f" (resuming at {human(before)})" if before
                                              else ""))
        try:
            if _host(url) in _unreachable:
                raise http.Unreachable(f"not tried ({_unreachable[_host(url)]} earlier in this "
                                       "run)", _host(url))
            check = "digest" if file.expected else "size" if file.size else None
            chain = http.download(url, file.partial, file.out.name, retries, file.timeouts,
                                  check, pinned=bool(file.hub), size=file.size)
        except http.Failed as e:
            say(f"{file.out.name}: {e}")
            if isinstance(e, http.Unreachable):  # not waited for again in this run
                _unreachable.setdefault(e.host, f"{url}: {e}")
            slow += isinstance(e, http.Slow)
            if (isinstance(e, http.Slow) and slow < file.tries) or (
                    isinstance(e, http.Cut) and size_of(file.partial) > before):
                continue
            return e
        # without a public record, a hub file is checked against the hub's own SHA-256
        return _settle(file, file.partial, file.expected or (
            published(chain) if file.hub else None))


def _from_urls(file):
    """The file from the first of its URLs that serves it: ``[(url, why not)]`` for each
    URL tried before, all of them when none did."""
    tried = []
    for url in file.urls:
        # once a host's name did not resolve, the others' connections are tried once
        lookups = not any(isinstance(getattr(why, "why", None), NameResolutionError)
                          for _, why in tried)
        failure = _from_url(file, url, http.retry(file.tries, file.backoff, lookups))
        if failure is None:
            break
        tried.append((url, failure))
    return tried


# ------------------------------------------------------------------------ one file


def _checked(urls, out, given, retries, timeout):
    """BadInput for what is wrong with fetch()'s arguments, before anything is fetched;
    returns the checksum to expect (given, or recorded by ``--record``) and the time-outs."""
    for url in urls:
        if any(ord(c) < 32 or ord(c) == 127 for c in url):
            raise BadInput(f"{url!r} holds a control character (a line break, a tab): give the "
                           "URL on one line")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- a port that is no number raises here
        except ValueError as e:
            raise BadInput(f"{url!r} is not a URL ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"{url!r} is not an http(s) URL")
    if out.is_dir():
        raise BadInput(f"{out} is a folder: give the file to write (--out FILE)")
    if not_a_file(out):  # a FIFO, /dev/null: a download would replace it
        raise BadInput(f"{out} is {not_a_file(out)}, not a regular file: give the file to "
                       "write (--out FILE)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{parent} is a file, not a folder")
    given = {k: v for k, v in given.items() if v}
    if len(given) > 1:
        raise BadInput("give one checksum: --sha256, --md5 or --sha1")
    if retries < 1:
        raise BadInput(f"--retries must be 1 or more, not {retries}")
    seconds("RDROP_FETCH_MAX_RETRY_AFTER", http.RETRY_AFTER_MAX)  # a bad value: refused now
    timeouts = (seconds("RDROP_FETCH_CONNECT_TIMEOUT", 10.0),
                positive(timeout, "--timeout") if timeout is not None
                else seconds("RDROP_FETCH_READ_TIMEOUT", 30.0))
    return (check_digest(*given.popitem()) if given else recorded(out)), timeouts


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


def _cached_or_stop(file):
    """The hub file's copy in the Hugging Face cache, or None; Offline or NoNetwork when
    nothing else could serve the file (OFFLINE=1, HF_HUB_OFFLINE=1, every host out of
    reach); also returns whether only the cache may be used."""
    cached = _hub_cached(file.hub) if file.hub else None  # used first, offline too
    hub_offline = bool(file.hub) and os.environ.get("HF_HUB_OFFLINE", "").upper() in (
        "1", "ON", "YES", "TRUE")
    if (offline() or hub_offline) and not cached:
        variable = "OFFLINE" if offline() else "HF_HUB_OFFLINE"
        raise Offline(f"{variable}=1 and {file.missing}", file.missing)
    if not (file.urls or cached):
        raise FetchError(f"no URL for {file.out}")
    if not cached and all(_host(u) in _unreachable for u in file.urls):
        why = _unreachable[_host(file.urls[-1])]
        raise NoNetwork(f"no network ({why}): {file.missing}", file.missing)
    return cached, offline() or hub_offline


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


def _fetch_locked(file, cached, cache_only):
    """Under the file's lock: the cached copy, then (unless offline) the URLs; returns why
    each failed, ``[]`` once the file is there. FetchError for a partial file that is a
    symbolic link."""
    http.refuse_links(file.partial)
    tried = []
    if cached:
        failure = _from_cache(file, cached)
        tried = [] if failure is None else [(str(cached), failure)]
    if not file.out.is_file() and not cache_only:
        tried += _from_urls(file)
    return [] if file.out.is_file() else tried


def _failure(file, tried, local_hint):
    """The FetchError for a file that no URL served: NoNetwork when none could be reached."""
    reasons = "; ".join(f"{url}: {why}" for url, why in tried)
    hint = f", or {local_hint}" if local_hint else ""
    if all(isinstance(why, http.Unreachable) for _, why in tried):
        return NoNetwork(f"cannot fetch {file.out.name}: {reasons}. No host could be reached; "
                         f"as with OFFLINE=1: {file.missing}{hint}", file.missing)
    return FetchError(f"cannot fetch {file.out.name}: {reasons}. Fetch it by hand "
                      f"({file.by_hand}){hint}")


def _fetched(file, record):
    file.bad.unlink(missing_ok=True)
    if file.expected is None and record:
        record_first_seen(file.out)
    say(f"{file.out} fetched" + (f", {file.expected[0]} verified" if file.expected else ""))
    return file.out


def _print_dry_run(urls, out):
    mirrors = f" (mirrors: {' '.join(urls[1:])})" if len(urls) > 1 else ""
    there = " (there already)" if out.is_file() else ""
    print(mask(f"++ fetch {urls[0] if urls else '(no URL)'} -> {out}{there}{mirrors}"),
          flush=True)
    return out


def fetch(urls, out, *, sha256=None, md5=None, sha1=None, size=None, timeout=None, retries=3,
          backoff=0.5, local_hint=None, record=False, hub=None):
    """Fetch ``out`` from the first of ``urls`` that serves it (``hub``: from the Hugging
    Face hub, ``{"repo", "type", "revision", "path"}``; see the package's docstring);
    returns ``out``. FetchError says why not (NoNetwork: no URL could be reached);
    BadInput is bad input, refused before anything is fetched. ``local_hint``: how to pass
    a local copy instead. ``record``: pin a file that has no checksum by its first
    download's SHA-256 (``--record``)."""
    out = Path(out)
    urls = [hub_url(hub, hub["path"])] if hub else list(urls)
    for url in urls:
        hide_credentials(url)
    expected, timeouts = _checked(urls, out, {"sha256": sha256, "md5": md5, "sha1": sha1},
                                  retries, timeout)
    if dry_run():  # no hashing either: a dry run reads nothing
        return _print_dry_run(urls, out)
    if out.is_file():
        return _there_already(out, expected, size, record)
    file = _File(out, urls, expected, size, hub, retries, backoff, timeouts)
    cached, cache_only = _cached_or_stop(file)
    made = make_folder(out.parent)
    try:
        with locked(out):
            if out.is_file():  # fetched by the run we waited for
                return _there_already(out, expected, size, record)
            tried = _fetch_locked(file, cached, cache_only)
    except KeyboardInterrupt:
        if size_of(file.partial):
            say(f"interrupted: {file.partial} keeps {human(size_of(file.partial))}; run again "
                "to resume")
        raise
    finally:
        if not size_of(file.partial):
            http.restart(file.partial)
        if not out.is_file():
            remove_made(made, out)  # only where empty: nothing else is left behind
    if tried:
        raise _failure(file, tried, local_hint)
    return _fetched(file, record)


# ------------------------------------------------------------------------ a source


def _missing_error(first, missing, entry):
    """One error naming every missing file of a source, as OFFLINE=1 does."""
    local = f" | or {entry['local']}" if entry.get("local") else ""
    if isinstance(first, NoNetwork):
        reasons = str(first).partition(" No host could be reached")[0]
        return NoNetwork(f"{reasons} No host could be reached; as with OFFLINE=1: "
                         + " | ".join(missing) + local, " | ".join(missing))
    return Offline(str(first).partition(" and ")[0] + ": " + " | ".join(missing) + local,
                   " | ".join(missing))  # OFFLINE=1 or HF_HUB_OFFLINE=1


def _fetch_files(entry, downloads, record, options):
    """The source's files in ``downloads``; every missing one named at once."""
    paths, missing, first = [], [], None
    for spec in entry["files"]:
        out = downloads / spec["name"]
        check = checksum_of(spec)
        try:
            fetch(spec.get("urls", []), out, size=spec.get("size"), record=record,
                  local_hint=entry.get("local"), hub=hub_of(entry, spec),
                  **({check[0]: check[1]} if check else {}), **options)
        except (Offline, NoNetwork) as e:
            if e.missing is None:
                raise
            first = first or e
            missing.append(e.missing)
        paths.append(out)
    if missing:
        raise _missing_error(first, missing, entry)
    return paths


def get(name, downloads, dest=None, table=None, record=False, **options):
    """The files of source ``name`` in ``downloads`` (fetched if missing), and with ``dest``
    DEST made from them (unless there already). Returns DEST, or the downloaded paths.
    ``options``: fetch()'s ``timeout``, ``retries``."""
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
    paths = _fetch_files(entry, Path(downloads), record, options)
    if dest is None:
        return paths
    if dry_run():
        print(f"++ make {dest} ({entry.get('make', 'copy')}) from "
              f"{', '.join(p.name for p in paths)}", flush=True)
        return dest
    make(entry.get("make", "copy"), paths, dest, entry)
    return dest
