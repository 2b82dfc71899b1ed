"""The source table: loading it and refusing what is not well formed or not pinned, the
hub's URLs, the makers that turn downloads into a folder (``unpack``: archive.py), and the
table as docs/data.md prints it."""

import importlib
import json
import os
import shutil
from pathlib import Path

from .archive import TooBig, Unreadable, UnsafeMember, unpack
from .base import WRITE_ERRORS, BadInput, FetchError, human, is_hex, locked, \
    make_folder, remove_made, say
from .verify import DIGESTS, check_digest, checksum_of

TABLE = Path(__file__).parents[1] / "sources.json"
HUB = "https://huggingface.co"
ENTRY_TEXT = ("make", "local", "manual", "licence", "used_by", "checksum_from")
FILE_TEXT = ("path", "no_public_record")


def hub_url(hub, path, endpoint=None):
    kind = {"dataset": "datasets/", "space": "spaces/"}.get(hub.get("type", "model"), "")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")
    return f"{endpoint}/{kind}{hub['repo']}/resolve/{hub['revision']}/{path}"


def hub_of(entry, spec):
    return dict(entry["hub"], path=spec["path"]) if entry.get("hub") else None


# ------------------------------------------------------------------------ loading


def load_sources(path=None):
    """The source table: ``{name: entry}`` (``RDROP_SOURCES`` replaces the packaged one).
    FetchError names an entry that is not pinned or not well formed: which field, and what
    it must be."""
    path = Path(path or os.environ.get("RDROP_SOURCES") or TABLE)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise FetchError(f"cannot read the source table {path}: {e}") from None
    if not isinstance(table, dict):
        raise FetchError(f"{path}: the table must be a JSON object of sources by name, not "
                         f"{_show(table)}")
    table = {k: v for k, v in table.items() if not k.startswith("_")}
    seen = {}
    for name, entry in table.items():
        try:
            _check_entry(name, entry)
            for spec in entry.get("files", []):
                _check_file(name, entry, spec)
                if spec["name"] in seen:
                    raise BadInput(f"{name} and {seen[spec['name']]} both name {spec['name']}")
                seen[spec["name"]] = name
        except BadInput as e:
            raise FetchError(f"{path}: {e}") from None
    return table


def _show(value):
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _must(where, field, value, what):
    return BadInput(f"{where}'s {field} must be {what}, not {_show(value)}")


def _check_text(where, mapping, fields):
    """Each of ``fields`` in ``mapping``, where given, is text."""
    for field in fields:
        if not isinstance(mapping.get(field, ""), str):
            raise _must(where, field, mapping[field], "text")


def _check_entry(name, entry):
    if not isinstance(entry, dict):
        raise _must("the table", name, entry, "an object (files, make, ...)")
    _check_text(name, entry, ENTRY_TEXT)
    files = entry.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise _must(name, "files", files, "a list of objects (name, urls, sha256, size)")
    if not files and not entry.get("manual"):
        raise BadInput(f"{name} needs files (or, where no host serves it, manual: what to do)")
    hub = entry.get("hub")
    if hub is not None:
        if not isinstance(hub, dict) or not all(isinstance(hub.get(k), str) and hub[k]
                                                for k in ("repo", "revision")):
            raise _must(name, "hub", hub, "an object with a repo and a revision")
        if not is_hex(hub["revision"], 40):  # a branch or tag moves: not pinned
            raise BadInput(f"{name}'s hub revision is {hub['revision']!r}: give the commit id "
                           "(40 hex digits) to fetch its files at")
        if hub.get("type", "model") not in ("model", "dataset", "space"):
            raise _must(name, "hub type", hub["type"], "model, dataset or space")
    make = entry.get("make", "copy")
    if make not in ("copy", "unpack") and not all(make.partition(":")[::2]):
        raise BadInput(f"{name}'s make is {make!r}: give copy, unpack or module:function")


def _check_file(name, entry, spec):
    if not (isinstance(spec.get("name"), str) and spec["name"]):
        raise _must(f"{name}'s file", "name", spec.get("name"), "the file's name")
    where = f"{name}'s {spec['name']}"
    _check_text(where, spec, FILE_TEXT)
    urls = spec.get("urls", [])
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise _must(where, "urls", urls, "a list of URLs")
    size = spec.get("size")
    if size is not None and (type(size) is not int or size < 1):
        raise _must(where, "size", size, "its number of bytes")
    for algorithm in DIGESTS:
        if spec.get(algorithm) is not None:
            check_digest(algorithm, spec[algorithm], where=f"{where}'s {algorithm}")
    if entry.get("hub") and (urls or not spec.get("path")):
        raise BadInput(f"{where} is on its hub: give its path in the repository, not urls")
    if not (entry.get("hub") or urls):
        raise BadInput(f"{where} needs urls")
    if not ((checksum_of(spec) and size) or spec.get("no_public_record")):
        raise BadInput(f"{where} is not pinned: give its sha256 (or md5, sha1) and size, or "
                       "say in no_public_record why none is known")


# ------------------------------------------------------------------------ making DEST


def _maker(kind):
    """The function that makes a folder from downloaded files: ``fn(paths, folder)``."""
    if kind == "copy":
        return lambda paths, folder: [shutil.copyfile(p, folder / p.name) for p in paths]
    if kind == "unpack":
        return lambda paths, folder: _unpack(paths[0], folder)
    module, _, function = kind.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise FetchError(f"the source table's make {kind!r} cannot be loaded ({e}): give "
                         "copy, unpack or module:function") from None


def _make_whole(maker, paths, dest):
    """DEST made in a sibling folder, then renamed: there whole, or not at all."""
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


def make(kind, paths, dest, entry):
    """DEST from the downloaded ``paths`` with the maker ``kind``. FetchError names the
    files and their source when they cannot be made into DEST; the downloads are left as
    they are (verified: the next run makes DEST from them)."""
    maker = _maker(kind)
    made = make_folder(dest.parent)
    try:
        _make_whole(maker, paths, dest)
    except (FetchError, BadInput):
        remove_made(made, dest)
        raise
    except Exception as e:  # the maker's own errors: a full disk, files it refuses
        remove_made(made, dest)
        if isinstance(e, OSError) and e.errno in WRITE_ERRORS:
            what, remedy = WRITE_ERRORS[e.errno]
            raise FetchError(f"{what} while making {dest}: {remedy} and run again (the "
                             "downloads are kept: nothing is fetched again)") from None
        source = ", ".join((f.get("urls") or [hub_url(entry["hub"], f.get("path", ""))])[0]
                           for f in entry["files"])
        raise FetchError(f"{', '.join(map(str, paths))} (from {source}) cannot be made into "
                         f"{dest}: {e.__class__.__name__}: {e}") from None
    except BaseException:
        remove_made(made, dest)
        raise
    say(f"{dest} made from {', '.join(p.name for p in paths)}")


def _unpack(archive, into):
    """The ``unpack`` maker: the archive's files into ``into`` (archive.unpack); a corrupt or
    unsafe archive, or one larger unpacked than the free space, is FetchError naming it."""
    try:
        unpack(archive, into)
    except UnsafeMember as e:
        raise FetchError(f"{archive} holds an unsafe path {e.member!r}") from None
    except TooBig as e:
        raise FetchError(f"{archive} unpacks to {human(e.size)}, more than the {human(e.free)} "
                         f"free on the disk of {into}: free space and run again (the download "
                         "is kept)") from None
    except Unreadable as e:
        raise FetchError(f"{archive} cannot be extracted: {e}") from None


# ------------------------------------------------------------------------ docs/data.md


def _row(name, entry, spec):
    check = checksum_of(spec)
    pin = f"{check[0]} `{check[1][:12]}…`" if check else ""
    if spec.get("no_public_record"):
        pin = f"{pin}; no size on record" if check else "no public record: " + (
            "the hub's sha256" if entry.get("hub") else "whole-file check")
    if entry.get("hub"):
        pin += f"; hub revision `{entry['hub']['revision'][:12]}`"
    size = human(spec["size"]) if spec.get("size") else "–"
    url = spec["urls"][0] if spec.get("urls") else hub_url(entry["hub"], spec["path"], HUB)
    return (f"| {name} | [{spec['name']}]({url}) | {size} | {pin} | "
            f"{entry.get('licence', '')} | {entry.get('used_by', '')} |")


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
        rows += [_row(name, entry, spec) for spec in entry["files"]]
    return "\n".join(rows) + "\n"
