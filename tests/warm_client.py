"""A stand-in for one of fairseq's tools in the directory ``warm_process.fairseq_bin()``
gives out (as FAIRSEQ_BIN): it hands its command line, working directory, environment and
standard input, output and error to the test worker that wrote it, which forks the command
warm (tests/warm_process.py), and it exits as the command does. A signal it gets (a
Ctrl-C, a recipe stopping its jobs) goes on to the command; one it was started with
ignored (SIGINT in a non-interactive shell's background job) the command ignores too, as
a real one would.

The stand-ins ``python`` and ``python3`` send only ``python -m MODULE ...`` of this
repository's packages (``runs_warm_as_python``); any other command line (``-c``, a script,
standard input, another module, an option before ``-m``) they hand to the real interpreter
(``REAL_PYTHON``, exec: same process, same descriptors).

Written into each stand-in after a header that sets SOCKET and REAL_PYTHON (None for
fairseq's tools); standard library only, run with ``python -S`` so that it starts in
milliseconds."""

import json
import os
import signal
import socket
import struct
import sys


def receive(conn, size):
    """``size`` bytes from the socket ``conn`` (the worker's side uses it too); EOFError if
    the other side closes first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the other side of the socket went away")
        data += chunk
    return data


def ignored_signals():
    """The signals this process was started with ignored (a real command would inherit
    that: e.g. SIGINT in a non-interactive shell's background job)."""
    return [int(sig) for sig in FORWARDED if signal.getsignal(sig) == signal.SIG_IGN]


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# the packages whose modules ``python -m`` runs warm: this repository's own
WARM_PACKAGES = ("rdrop_fairseq", "experiments")


def runs_warm_as_python(argv):
    """Whether the interpreter command line ``argv`` (``python -m MODULE ARGS``, nothing
    before -m) runs a module of WARM_PACKAGES, which the worker can fork warm."""
    return (len(argv) >= 3 and argv[1] == "-m"
            and argv[2].split(".")[0] in WARM_PACKAGES)


def main(path):
    if REAL_PYTHON and not runs_warm_as_python(sys.argv):  # noqa: F821 - set by the header
        os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])  # noqa: F821
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    ignored = ignored_signals()
    request = json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                          "ignored": ignored}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(request))], [0, 1, 2])
    conn.sendall(request)
    try:
        pid = struct.unpack("!i", receive(conn, 4))[0]
        for sig in set(FORWARDED) - set(ignored):  # an ignored one stays ignored
            signal.signal(sig, lambda number, _: os.kill(pid, number))
        code = struct.unpack("!i", receive(conn, 4))[0]
    except EOFError:
        sys.exit(f"{sys.argv[0]}: the test worker that runs this command went away")
    if code < 0:  # the command died of a signal: so does its stand-in
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(SOCKET)  # noqa: F821 - set by the header warm_process writes
