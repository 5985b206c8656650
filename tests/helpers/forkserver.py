"""Launches of llmtrain's entry points without the ~3.5 s of CPU each process's imports cost (torch,
transformers, llmtrain): a server, started once per test process, imports them and then forks a child per
launch that runs the script or module as `python` would (`__main__`, its argv, sys.path[0], environment, exit
code, atexit), or nproc of them as the ranks torchrun --standalone would start (RANK, WORLD_SIZE, MASTER_ADDR,
... ; no agent: the monitor process between server and ranks stops the others once one fails and reports 1, as
torchrun does, and passes SIGTERM / SIGINT on). helpers/launcher.py's spawn uses it for a recipe, `-m
llmtrain.X` or a worker script launched with torchrun=None and no extra environment, under the environment the
server imported under (anything an import reads at start-up, e.g. HF_DATASETS_CACHE, would be stale otherwise: a
test that changed it gets a new server); a test of torchrun's own part asks for torchrun=True.
tests/train/test_features.py checks that a forked run equals a fresh process and torchrun's ranks. The run (one
process) or the monitor (ranks) leads a session of its own (a timeout kills the group, as for a fresh process);
output goes to pipes created by the caller, passed over the server's Unix socket.

    python tests/helpers/forkserver.py SOCKET MODULE...     # the server, importing MODULEs (launcher.py starts it)
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

VOLATILE = ("PYTEST_CURRENT_TEST",)
PRELOAD = ("torch", "transformers", "llmtrain.recipes", "llmtrain.recipes.sft", "llmtrain.recipes.dpo",
           "llmtrain.recipes.grpo", "llmtrain.recipes.distill")
CLEAN = ("torch", "transformers")  # a clean server's: for workers that must run without llmtrain imported


def serve(path: str, preload: list[str]) -> None:
    """Import `preload`, then fork a monitor per request: {"argv": [script or -m module, args...], "cwd": ...,
    "env": {...}} with two descriptors (stdout, stderr) passed along."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".bound")
    listener.listen(16)
    # the client takes the path's existence for "ready": it appears listening (between bind and listen, a
    # connect is refused: a fresh server lost a launch that way)
    os.rename(path + ".bound", path)
    listener.settimeout(5)
    client = os.getppid()
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != client:  # the test process is gone (killed: its atexit never ran)
                return
            continue
        fds = []
        try:  # a bad request fails alone: its connection closes before a pid is sent (Forked raises)
            conn.settimeout(None)
            raw, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            while chunk := conn.recv(1 << 20):  # the client half-closes after the request: read up to there
                raw += chunk
            request = json.loads(raw)
            if os.fork() == 0:
                try:  # the child never returns into this loop, whatever monitor raises (into the log)
                    listener.close()
                    monitor(conn, request, fds)
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                finally:
                    os._exit(1)
        except Exception:  # noqa: BLE001 (the server outlives a bad request; its log says why)
            traceback.print_exc()
            sys.stderr.flush()
        conn.close()
        for fd in fds:  # the child's copies only: a pipe reaches EOF when the child and its own children close it
            os.close(fd)


def monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Fork the run (request["nproc"] ranks), send the pid to signal and wait on, then the exit status.
    One process: its own pid and session, its exit status (negative: killed by that signal). Several ranks: the
    monitor leads their session (its pid is sent), passes SIGTERM / SIGINT on to them, stops the others once one
    fails (as torchrun's agent does) and reports 1 if any failed, else 0."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    nproc = request["nproc"]
    if nproc > 1:
        os.setsid()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            run(request, fds, rank if nproc > 1 else None)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    if nproc == 1:
        conn.sendall(f"{pids[0]}\n".encode())
        _, status = os.waitpid(pids[0], 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        os._exit(0)
    running = set(pids)

    def forward(signum, frame):
        for p in running:
            os.kill(p, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    conn.sendall(f"{os.getpid()}\n".encode())
    failed = False
    while running:
        pid, status = os.wait()
        running.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            forward(signal.SIGTERM, None)
    conn.sendall(f"{int(failed)}\n".encode())
    os._exit(0)


def run(request: dict, fds: list[int], rank: int | None) -> None:
    """What `python SCRIPT ARGS` or `python -m MODULE ARGS` does, in this already-importing process; as `rank`
    of request["nproc"] with the variables torchrun --standalone sets (None: one process, its own session)."""
    if rank is None:
        os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if rank is not None:
        n = str(request["nproc"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, ROLE_WORLD_SIZE=n, GROUP_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]), TORCHELASTIC_RESTART_COUNT="0",
                          TORCHELASTIC_MAX_RESTARTS="0")
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_status(line: str) -> int:
    """A run's exit status from the server's line; none (the connection closed): the monitor was killed with its
    ranks' group (a timeout), as SIGKILL."""
    return int(line) if line else -signal.SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without(environ: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in environ.items() if k not in keys}


class Server:
    """The client's side: the server process, started on first use, and the environment it imported under."""

    def __init__(self, cwd: str, environ: dict, preload: tuple[str, ...] = PRELOAD):
        # A Unix socket's path has at most ~107 bytes: under /tmp, whatever TMPDIR is
        short = "/tmp" if os.path.isdir("/tmp") else None
        self.path = os.path.join(tempfile.mkdtemp(prefix="llmtrain-fork-", dir=short), "socket")
        self.cwd, self.environ = cwd, environ
        self.log = open(self.path + ".log", "w")  # the server writes here as long as it runs
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, *preload], cwd=cwd, env=environ,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (its log: {self.path}.log)")
            time.sleep(0.05)

    def died(self) -> str | None:
        """None while the server runs; else how it ended, with the end of its log."""
        if self.proc.poll() is None:
            return None
        try:
            with open(self.path + ".log") as log:
                tail = log.read()[-2000:]
        except OSError:
            tail = ""
        return f"exit status {self.proc.returncode}; the end of its log:\n{tail}"

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def imported_under(self, environ: dict) -> bool:
        """Whether the server imported under `environ` (what imports read at start-up would be stale otherwise);
        pytest's PYTEST_CURRENT_TEST, which changes with every test and is read by none, aside."""
        return _without(environ, VOLATILE) == _without(self.environ, VOLATILE)

    def start(self, argv: list[str], environ: dict, nproc: int = 1) -> Forked:
        """Run `python *argv` with `environ` as a child of the server (nproc: ranks, as torchrun --standalone
        would start them); its output comes back through pipes made here."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(self.path)
        request = {"argv": argv, "cwd": self.cwd, "env": environ, "nproc": nproc,
                   "port": free_port() if nproc > 1 else None}
        socket.send_fds(conn, [json.dumps(request).encode()], [out_w, err_w])
        conn.shutdown(socket.SHUT_WR)  # the request's end: a stream socket may deliver it in several reads
        os.close(out_w)
        os.close(err_w)
        return Forked([sys.executable, *argv], conn, open(out_r), open(err_r))


class Forked:
    """What the tests use of a subprocess.Popen (pid, args, stdout, stderr, returncode, poll, wait, communicate,
    send_signal, terminate, kill), for a child of the fork server."""

    def __init__(self, args: list[str], conn: socket.socket, stdout, stderr):
        self.args, self.stdout, self.stderr, self.returncode = args, stdout, stderr, None
        self._conn, self._buffer, self._readers, self._output = conn, b"", None, None
        pid = self._line(None)
        if not pid:
            raise RuntimeError("the fork server refused the request (its log says why)")
        self.pid = int(pid)

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line (the pid, then the exit status), None if none came within timeout, "" if the
        connection closed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            self._conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0))
            try:
                chunk = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None and (line := self._line(0)) is not None:
            self.returncode = _exit_status(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = _exit_status(line)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end and wait for the exit, as Popen.communicate (TimeoutExpired: call again)."""
        if self._readers is None:
            self._output = {"out": [], "err": []}
            self._readers = [threading.Thread(target=lambda f=f, key=key: self._output[key].append(f.read()),
                                              daemon=True)
                             for key, f in (("out", self.stdout), ("err", self.stderr))]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        self.stdout.close()
        self.stderr.close()
        return "".join(self._output["out"]), "".join(self._output["err"])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
