"""How a download is known to be the file: digests, the hub's published SHA-256, a Hugging
Face cache's blob names, archives read whole (archive.py), and ``--record``."""

import hashlib
import os
from pathlib import Path

from .archive import Unreadable, read_whole
from .base import CHUNK, BadInput, is_hex, say

DIGESTS = {"sha256": 64, "md5": 32, "sha1": 40}


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
        raise BadInput(f"unknown checksum {algorithm!r}: give {', '.join(DIGESTS)}")
    value = value.strip().lower() if isinstance(value, str) else value
    if not (isinstance(value, str) and is_hex(value, DIGESTS[algorithm])):
        raise BadInput(f"{where or '--' + algorithm} must hold {DIGESTS[algorithm]} hex "
                       f"digits, not {value!r}")
    return algorithm, value


def checksum_of(spec):
    """The first checksum a table file names, ``(algorithm, hex)``, or None."""
    for algorithm in DIGESTS:
        if spec.get(algorithm):
            return algorithm, spec[algorithm]
    return None


def published(chain):
    """The SHA-256 the hub publishes for a file it keeps in git LFS, as ``("sha256", hex)``,
    from the headers of its answers: the X-Linked-Etag of one (a redirect to its storage),
    or the ETag of a single answer (the file served itself); None for a file kept in git
    (its ETag is a git blob id)."""
    tags = [h.get("X-Linked-Etag") for h in chain] + [chain[0].get("ETag")] * (len(chain) == 1)
    tag = next((t for t in tags if t), "").strip('"')
    return ("sha256", tag) if is_hex(tag, 64) else None


def cached_digest(path):
    """The SHA-256 that a Hugging Face cache names a snapshot's file by: the name of the
    blob its own link points to, ``blobs/<sha256>`` for a file in git LFS. Not the end of
    the links: huggingface_hub 2.x links a Xet-backed blob on into a shared store
    (``blobs/xx/<xet hash>``), whose name is no SHA-256. None for a copy that is no link."""
    try:
        name = Path(os.readlink(path)).name
    except OSError:  # a cache without links (HF_HUB_DISABLE_SYMLINKS, some file systems)
        return None
    return ("sha256", name) if is_hex(name, 64) else None


# ------------------------------------------------------------------------ --record


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


# ------------------------------------------------------------------------ the whole file


def verify(path, expected, size, name):
    """None if the complete download ``path`` is the file, else what is wrong with it.
    Without a checksum, an archive is read whole as the kind ``name`` says (a cut or
    corrupt one fails)."""
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, not {size}"
    if expected is not None:
        digest = file_digest(path, expected[0])
        return None if digest == expected[1] else \
            f"a file with the wrong checksum ({expected[0]} {digest}, not {expected[1]})"
    try:
        read_whole(path, name)
    except Unreadable as e:
        return f"a corrupt archive ({e})"
    return None
