"""Download the recipes' inputs: pinned, verified, resumed after a cut, with progress.

    python -m rdrop_fairseq.recipes.fetch [--sha256 HEX | --md5 HEX | --sha1 HEX] [--record] \\
        --out FILE URL [URL ...]
    python -m rdrop_fairseq.recipes.fetch --dir DOWNLOADS [--record] NAME[=DEST] ...
    python -m rdrop_fairseq.recipes.fetch --list          # the source table, as docs/data.md prints it

The first form fetches one file from the first URL that serves it. The second fetches the
files of the named sources of the source table (``sources.json`` beside this package, or the
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
  name, except for the hosts of ``no_proxy``, asking for the file uncompressed
  (``Accept-Encoding: identity``);
* compression a server applies anyway (``Content-Encoding`` gzip, x-gzip or deflate) is
  decoded on the way, so that FILE is the file; a cut decoded download starts again from
  zero (the server's ranges count compressed bytes). Where FILE's name says it is
  compressed that way itself (``.gz``, ``.tgz``), the body is kept as served (a
  ``.tar.gz`` sent with ``Content-Encoding: gzip`` is not unpacked), and its checksum,
  its size, or reading the tarball through, tells a second compression from the file; a
  ``.gz`` that nothing checks, and a coding not decoded here (br, zstd, several), are
  refused;
* one connection pool (a requests Session) for the run, closed at its end;
* each try waits ``RDROP_FETCH_CONNECT_TIMEOUT`` seconds (default 10) to connect and
  ``RDROP_FETCH_READ_TIMEOUT`` (default 30; ``--timeout``) for data; 5xx and 429 answers,
  time-outs and temporary name-lookup failures are tried again by urllib3's Retry, with
  back-off, ``--retries`` tries in all, then the next URL; a 429's or 503's
  ``Retry-After`` is waited for up to ``RDROP_FETCH_MAX_RETRY_AFTER`` seconds (default
  120; a wait over 3 s is said), and a longer one moves on, saying when the server asked
  to be tried again (one that is neither seconds nor a date is said, and the usual
  back-off taken);
* into ``FILE.partial``, resumed with a Range request and ``If-Range`` (the partial file's
  ETag or Last-Modified; a hub file, at a commit, without): a file that changed meanwhile
  is fetched afresh, never spliced, and so is one whose server answers with a 206 that
  does not carry the ETag or Last-Modified asked for. The validator is kept with the URL
  it came from (``FILE.partial.validator``) and used for that URL only. Without one, only
  a file with a checksum to check the result resumes; another starts afresh. An answer
  that is refused leaves the partial file as it was. A download cut after some bytes, or
  an answer shorter than its Content-Range or Content-Length promised, resumes at once;
  Ctrl-C keeps the partial file for the next run; so do a full disk or quota and a
  read-only file system, where the next run resumes (else, for a decoded answer or one
  with nothing to resume against, the partial file is removed, and the error says so). The partial file and its validator are opened without following a symbolic
  link (one there is an error);
* the framing of every answer is checked against the request and the first answer: a 206
  only where it begins at the byte asked for (0 without a Range) with the total the
  first answer gave; a 200 only without a Content-Range that says it holds less than the
  whole file; a 416 proves the partial whole only where its total is the size promised
  (pinned, or first announced) or a checksum will check; any other status that is not a
  redirect followed is refused (a redirect without Location, 300, 304), and so are a
  Content-Length or Content-Range that is no number and a Location that is no URL;
* an answer brings no more than its Content-Length or Content-Range announced, else the
  pinned size, else (no length, or decoded) the free space of the disk as it begins; past
  that, the partial file is deleted, not resumed. Unpacking is refused, before anything
  is written, where the members' declared sizes add up to more than the free space;
* a try that receives less than 1 KiB in any ``--timeout`` seconds (a trickle) is ended,
  and tried again as a time-out is;
* 403, 404 and other refusals move to the next URL at once; so does a host that cannot be
  reached (refused, no route, a name that does not exist). When no URL of a file can be
  reached, its hosts are not waited for again in the run: without network the error names
  every missing file, where it comes from and how to fetch it by hand, as ``OFFLINE=1``
  does, within seconds;
* an HTML page where a file was expected is refused (a login or quota page served with
  200): ``text/html`` or ``application/xhtml+xml`` in any case, or a body that begins
  ``<!DOCTYPE html`` or ``<html``, after a byte-order mark, an ``<?xml ...?>``
  declaration or ``<!-- comments -->``;
* a pinned size is compared with the size the answer announces, before its body;
* an ``--out`` that is there and is no regular file (a FIFO, a device such as
  ``/dev/null``) is refused before anything is written, and so is one beside which the
  lock file cannot be made; credentials in a URL (``user:password@``, whatever they
  hold: the URL is parsed) are shown as ``***@`` in every message, and a URL with a
  control character (a line break) is refused; every error is one line (exit status 1,
  2 for bad input);
* a FILE already there and verified is not fetched again; two runs fetching one file, or
  making one DEST, take turns (a lock file ``.NAME.lock`` beside it).

Making DEST never condemns a download: after a failure (a full disk while unpacking, say)
the verified files stay, and the next run makes DEST from them without fetching again.

Environment: ``OFFLINE=1`` fetches nothing: it names each missing file, where it comes
from and the command that fetches it by hand. ``DRY_RUN=1`` prints each URL and
destination. ``RDROP_SOURCES=table.json`` replaces the source table (one not well formed,
or with a bad checksum, is refused as it is loaded, naming the source and the field).
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are huggingface_hub's. Exit status 0 only when every
file asked for is there, verified.
"""

# what the recipes, the experiments and the tests use
from .base import BadInput, FetchError, NoNetwork, Offline  # noqa: F401
from .core import fetch, get  # noqa: F401
from .table import TABLE, hub_url, load_sources, markdown_table  # noqa: F401
from .verify import check_digest  # noqa: F401
