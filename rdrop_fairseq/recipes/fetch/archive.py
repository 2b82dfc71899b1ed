"""The downloader's archives, the one place that reads them: ``read_whole()`` tells whether a
download is a whole archive of the kind its name says, ``unpack()`` extracts one into a
folder. Each way an archive can fail is an exception whose message says what is wrong
with the archive, never which file it is: the caller names the file and its source in a
sentence of its own. Unreadable (cut, a bad CRC, not the kind its name says), UnsafeMember
(a member whose path is absolute or leaves the folder), TooBig (more than the
free space, unpacked). An OSError that says the disk is
full, over quota or read-only passes as it is: the archive is not at fault."""

import os
import shutil
import tarfile
import zipfile
import zlib
from pathlib import Path

from .base import CHUNK, WRITE_ERRORS

# what the standard library raises for an archive that is not whole or not an archive
# (gzip's BadGzipFile, "CRC check failed", is an OSError; zlib.error, a corrupt stream)
_BROKEN = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError)


class Unreadable(Exception):
    """An archive that cannot be read to its end: the message is the reason."""


class TooBig(Exception):
    """An archive whose members' declared sizes add up to ``size`` bytes, more than the
    ``free`` bytes of the disk it would be unpacked on: refused before anything is written
    (the members cannot unpack to more than they declare: zipfile and tarfile stop there)."""

    def __init__(self, size, free):
        super().__init__(f"{size} bytes unpacked, {free} free")
        self.size, self.free = size, free


class UnsafeMember(Exception):
    """A member whose path is absolute or climbs out of the folder (``..``): ``member``."""

    def __init__(self, member):
        super().__init__(f"an unsafe path {member!r}")
        self.member = member


def _reason(e):
    """Unreadable for what the standard library raised, in one line; a write error as it
    is."""
    if isinstance(e, OSError) and e.errno in WRITE_ERRORS:
        return e
    return Unreadable(" ".join(str(e).split()))


def _open_tar(path):
    try:
        return tarfile.open(path)
    except tarfile.ReadError:  # tarfile lists each compression it tried, on lines of its own
        raise Unreadable("not a tar archive (plain, gzip, bz2 or xz), or cut before its "
                         "first member") from None


def _safe(name):
    """``name`` as a relative path inside the folder, or UnsafeMember."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafeMember(name)
    return rel


def _to_the_end(tar):
    """The rest of a tarball's stream read: gzip checks its CRC at the end only."""
    if tar.fileobj is not None:
        while tar.fileobj.read(CHUNK):
            pass


def _read_tar(path):
    with _open_tar(path) as tar:
        for member in tar:
            if member.isfile():
                with tar.extractfile(member) as f:
                    while f.read(CHUNK):
                        pass
        _to_the_end(tar)


def _read_zip(path):
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()
    if bad:
        raise zipfile.BadZipFile(f"a bad CRC in {bad}")


def _read_parquet(path):
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(-4, os.SEEK_END)
        if head != b"PAR1" or f.read(4) != b"PAR1":
            raise ValueError("no parquet magic at its start and end")


def read_whole(path, name=None):
    """Read the archive ``path`` to its end, as the kind its ``name`` (default: the path's)
    says: ``.zip``, ``.tar.gz``/``.tgz``/``.tar``, ``.parquet`` (its magic at both ends);
    other files pass unread. Unreadable if it is cut or corrupt."""
    name = name or Path(path).name
    reader = (_read_zip if name.endswith(".zip") else
              _read_tar if name.endswith((".tar.gz", ".tgz", ".tar")) else
              _read_parquet if name.endswith(".parquet") else None)
    if reader is None:
        return
    try:
        reader(path)
    except (*_BROKEN, ValueError) as e:
        raise _reason(e) from None


# ------------------------------------------------------------------------ unpacking


def common_top(names):
    """``"top/"`` when every name lies under one top folder, else ``""``."""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and all("/" in n for n in names):
        return tops.pop() + "/"
    return ""


def _room_for(into, sizes):
    """TooBig where the declared ``sizes`` add up to more than the free space of ``into``."""
    existing = Path(into)
    while not existing.exists() and existing != existing.parent:  # a folder still to make
        existing = existing.parent
    size, free = sum(sizes), shutil.disk_usage(existing).free
    if size > free:
        raise TooBig(size, free)


def _unzip(archive, into):
    with zipfile.ZipFile(archive) as zf:
        _room_for(into, (info.file_size for info in zf.infolist() if not info.is_dir()))
        top = common_top([n for n in zf.namelist() if not n.endswith("/")])
        for info in zf.infolist():
            if info.is_dir():
                continue
            _safe(info.filename)  # as the archive names it, then below the top folder
            rel = _safe(info.filename[len(top):])
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(into / rel, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)


def _untar(archive, into):
    with _open_tar(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        _room_for(into, (m.size for m in members))
        top = common_top([m.name for m in members])
        for m in members:
            _safe(m.name)  # as the archive names it, then below the top folder
            m.name = str(_safe(m.name[len(top):]))
        tar.extractall(into, members=members, filter="data")  # its checks too
        _to_the_end(tar)


def unpack(archive, into):
    """The files of the archive ``archive`` (a zip, else a tarball) into the folder ``into``,
    without their common top folder (``roberta.base/``, ``RTE/``); links and other
    members that are no regular file are left out. Unreadable if it is cut, corrupt or
    refused by tarfile's ``data`` filter; UnsafeMember for a member whose path is absolute
    or climbs out (``..``)."""
    try:
        (_unzip if zipfile.is_zipfile(archive) else _untar)(archive, into)
    except _BROKEN as e:
        raise _reason(e) from None
