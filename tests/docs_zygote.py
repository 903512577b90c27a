"""A warm interpreter that forks one child per documented command (``tests/test_docs_examples.py``).

Most of a documented example's run time used to be the interpreter start: every ``lightning-dvi``
or ``python`` command of a page paid ~8 s of CPU importing torch, Lightning (which imports
``torch._dynamo``), scikit-learn and the library before doing two epochs of work. The harness now
starts one *zygote* per test process: it imports those modules once, runs no tensor code (so no
thread pool exists to break across ``fork``), and listens on a Unix socket.

Usage::

    python tests/docs_zygote.py serve SOCKET     # the zygote (the harness starts it)
    python tests/docs_zygote.py ARGS...          # a client: what `docs_runner.py ARGS...` runs

A client sends its arguments, working directory, environment and its three standard file
descriptors (``SCM_RIGHTS``) and waits. The zygote forks a monitor per request, which forks the
worker: the worker takes over the client's stdin/stdout/stderr, directory and environment, sets
``sys.argv`` to ``[docs_runner.py, *ARGS]`` (so DDP's re-launch of ``sys.argv`` starts a plain
``docs_runner.py`` process) and runs ``docs_runner.main``; its exit (a ``SystemExit``, an uncaught
exception's traceback and status 1, the join of non-daemon threads, ``atexit`` handlers) is an
interpreter's, without the module teardown (``os._exit``: ~2 s of CPU per command saved). The
monitor sends the worker's exit status back (a signal ``-N`` is re-raised by the client) and kills
the worker's process group if the client goes away (the test's timeout). Without ``SOCKET`` in the
environment (``ZYGOTE_ENV``) the client simply ``exec``\\ s ``docs_runner.py``: the same commands,
one fresh interpreter each.

Only the standard library is imported at module level, so a client starts in milliseconds.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import NoReturn

ZYGOTE_ENV = "LIGHTNING_DVI_DOCS_ZYGOTE"
RUNNER = Path(__file__).resolve().parent / "docs_runner.py"
READY = "zygote ready"
# What every documented command imports anyway; nothing here runs tensor code at import.
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "lightning_dvi",
    "lightning_dvi.cli",
    "lightning_dvi.data",
    "lightning_dvi.pyro",
    "lightning_dvi.nn.export",
    "pyro",
    "sklearn.datasets",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "docs_runner",
)
_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!i")


def serve(path: str) -> None:
    """Import ``PRELOAD``, then fork a monitor for every request on the socket at ``path``."""
    for name in PRELOAD:
        importlib.import_module(name)
    # The imported objects leave the collector's view: a collection in a fork then never writes
    # to (and so copies) the zygote's pages.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(READY, flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _monitor(conn)  # never returns: the monitor and the worker end with os._exit
            os._exit(1)
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < _HEADER.size:
        data += conn.recv(1 << 16)
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        data += chunk
    return json.loads(data[_HEADER.size :]), list(fds)


def _monitor(conn: socket.socket) -> None:
    request, fds = _receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [str(RUNNER), *request["argv"]]
        _run_and_exit(request["argv"])
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = select.select([conn], [], [], 0.1)
        if readable and not conn.recv(1):  # the client is gone: so is its command
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)
    conn.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
    os._exit(0)


def _run_and_exit(argv: list[str]) -> NoReturn:
    """Run ``docs_runner.main(argv)`` and exit as the interpreter would, minus its teardown.

    What a fresh interpreter does at exit, in its order: an uncaught exception's traceback
    (status 1) or ``SystemExit``'s status, the join of non-daemon threads, ``atexit`` handlers,
    flushed streams. Then ``os._exit``: finalizing the modules the zygote imported (a collection
    over a heap shared copy-on-write) cost ~2 s of CPU per command, the command itself often less.
    """
    import docs_runner

    try:
        docs_runner.main(argv)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed stream
            stream.flush()
    os._exit(code)


def client(argv: list[str]) -> None:
    """Run ``docs_runner.py argv`` in a fork of the zygote (or in a fresh interpreter)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path or not os.path.exists(path):
        os.execv(sys.executable, [sys.executable, str(RUNNER), *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], [0, 1, 2])
    reply = b""
    while len(reply) < _STATUS.size:
        chunk = conn.recv(_STATUS.size - len(reply))
        if not chunk:
            raise SystemExit("the docs zygote died before the command ended")
        reply += chunk
    (code,) = _STATUS.unpack(reply)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
