"""The downloader's command line: ``python -m rdrop_fairseq.recipes.fetch --help``."""

import argparse
import sys
from pathlib import Path

from .. import fetch as package
from ..common import ArgumentParser
from . import http
from .base import BadInput, FetchError, NoNetwork, Offline, mask, positive, write_error
from .core import fetch, get
from .table import load_sources, markdown_table


def _seconds(value):
    try:
        return positive(value, "--timeout")
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser():
    doc = package.__doc__.split("\n\n")
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
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="seconds without data before a try counts as timed out (default: "
                        "RDROP_FETCH_READ_TIMEOUT, else 30)")
    p.add_argument("--retries", type=int, default=3,
                   help="tries per URL on 5xx, 429, time-outs and temporary name-lookup "
                        "failures (default 3); a download cut after some bytes resumes")
    return p


def _sources(a):
    """The named sources; with no network, every missing input named before it fails."""
    table, errors = load_sources(), []
    for item in a.items:
        name, _, dest = item.partition("=")
        try:
            get(name, a.dir, dest or None, table, record=a.record, timeout=a.timeout,
                retries=a.retries)
        except (Offline, NoNetwork) as e:
            errors.append(str(e))
    if errors:
        raise FetchError("\n".join(errors))


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if bool(a.out) == bool(a.dir) and not a.list:
        p.error("give --out FILE with URLs, or --dir DOWNLOADS with source names")
    if not (a.items or a.list):
        p.error("nothing to fetch: give URLs (with --out) or source names (with --dir)")
    if a.dir and (a.sha256 or a.md5 or a.sha1):
        p.error("--sha256/--md5/--sha1 go with --out; the table holds the sources' checksums")
    try:
        if a.list:
            print(markdown_table(), end="")
        elif a.out:
            fetch(a.items, a.out, sha256=a.sha256, md5=a.md5, sha1=a.sha1, timeout=a.timeout,
                  retries=a.retries, record=a.record)
        else:
            _sources(a)
    except BadInput as e:
        p.error(str(e))
    except FetchError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # writing: a full disk or quota, a read-only file system, no rights
        sys.exit(f"error: {mask(write_error(e, a.out or a.dir))}")
    except Exception as e:  # noqa: BLE001 -- whatever else: one line, never a traceback
        sys.exit(mask(f"error: {e.__class__.__name__}: {' '.join(str(e).split())}"))
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        http.close()


if __name__ == "__main__":
    main()
