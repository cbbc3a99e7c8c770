"""A fork server for the tests' `bulkgen` processes: real processes, without paying torch's and transformers' imports
(about 3.5 s of CPU on these machines) each time a test starts one.

The server imports what `bulkgen run` imports, then forks a child for each request; the child takes the request's
stdin, stdout and stderr (passed over a Unix socket), its working directory and its environment, and runs the CLI
as `python -m bulkgen ARGS` would, in a process of its own: a test kills it, stops it, reads its output and its
exit status as it would a `subprocess.Popen`'s (`ZygoteProcess` has the methods the tests use). The server runs
one thread (forking a process that has others is unsafe) and reaps its children as they end, so a killed worker is
gone at once for the store's liveness checks too.

A request whose environment differs from the server's where a library reads it at import (torch's and oneDNN's
instruction sets, thread counts, Triton, the hub) runs as a plain subprocess instead, as does every request when
BULKGEN_TEST_ZYGOTE=0 (the suite then runs as it did without the server).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# environment variables read when torch, transformers, triton or the hub are imported: a request that changes one
# runs as a plain subprocess
IMPORT_TIME_PREFIXES = ("ATEN_", "ONEDNN_", "DNNL_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "TRITON", "HF_",
                        "TRANSFORMERS", "CUDA", "PYTHON", "LD_", "TOKENIZERS")


# ---------------------------------------------------------------------------------------------- the server


def _preload() -> None:
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import bulkgen.cli.jobs  # noqa: F401
    import bulkgen.cli.run  # noqa: F401
    import bulkgen.engine.engine  # noqa: F401
    import bulkgen.engine.runner  # noqa: F401


def serve(path: str) -> None:
    _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the client told of its end
    ended: dict[int, int] = {}  # child pid -> its exit code, ended before its client asked
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    _child(json.loads(message), fds, [conn.fileno(), wake_r, wake_w])
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                waiting[pid] = conn
            else:
                os.read(wake_r, 4096)
        while True:  # reap every child that ended, and tell its client
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()
            else:
                ended[pid] = os.waitstatus_to_exitcode(status)


def _child(request: dict[str, Any], fds: list[int], close: list[int]) -> None:
    """In the forked child: become `python -m bulkgen ARGS` with the request's streams, directory and environment."""
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        sys.argv = [str(REPO / "bulkgen" / "__main__.py"), *request["args"]]
        import logging

        logging.root.handlers.clear()  # as in a fresh interpreter: the CLI configures its own
        from bulkgen.cli import cli

        try:
            cli.main(args=request["args"], prog_name="bulkgen")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - what python -m would print
            import traceback

            traceback.print_exc()
            code = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------------- the client


class _Server:
    """The test process's one server, started at first use, ended at exit."""

    process: subprocess.Popen | None = None
    path: str | None = None
    lock = threading.Lock()
    env: dict[str, str] = {}

    @classmethod
    def follow(cls) -> None:
        """The test process's own environment changed where imports read it (a library's init that sets a variable
        and leaves it, as ray.init does PYTHONBREAKPOINT): the next request starts a server with it, rather than
        every later request running as a plain subprocess."""
        with cls.lock:
            if cls.process is not None and _import_time(dict(os.environ)) != _import_time(cls.env):
                cls.process.kill()
                cls.process.wait()
                cls.process = None

    @classmethod
    def socket_path(cls) -> str:
        with cls.lock:
            if cls.process is None or cls.process.poll() is not None:
                cls.path = os.path.join(tempfile.mkdtemp(prefix="bulkgen-zygote-"), "socket")
                cls.env = dict(os.environ)
                cls.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", cls.path], cwd=REPO,
                                               stdout=subprocess.PIPE, text=True)
                assert cls.process.stdout.readline().strip() == "ready", "the fork server did not start"
                atexit.register(cls.process.kill)
            return cls.path


def _import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables of an environment that imports read (the child's streams are unbuffered anyway)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONUNBUFFERED"}


def usable(env: dict[str, str]) -> bool:
    """Whether a request with this environment may run in a forked child (see the module's docstring)."""
    if os.environ.get("BULKGEN_TEST_ZYGOTE", "1") == "0":
        return False
    _Server.follow()
    return _import_time(env) == _import_time(_Server.env or dict(os.environ))


class ZygoteProcess:
    """A forked `bulkgen ARGS` process, with the parts of subprocess.Popen the tests use."""

    def __init__(self, args: list[str], stdin: Any = None, stdout: Any = None, stderr: Any = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None, text: bool = True) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        ends: list[int] = []  # the child's stdin, stdout, stderr
        to_close: list[int] = []  # ours to close once sent
        for number, (name, spec) in enumerate((("stdin", stdin), ("stdout", stdout), ("stderr", stderr))):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if number == 0 else (r, w)
                mode = ("w" if number == 0 else "r") + ("" if text else "b")
                setattr(self, name, open(mine, mode, **({"encoding": "utf-8"} if text else {})))
                ends.append(child)
                to_close.append(child)
            elif spec == subprocess.STDOUT:
                ends.append(ends[1])
            elif spec == subprocess.DEVNULL:
                ends.append(os.open(os.devnull, os.O_RDWR))
                to_close.append(ends[-1])
            elif spec is None:  # inherited, as Popen does
                ends.append(number)
            else:  # a file object or a descriptor
                ends.append(spec if isinstance(spec, int) else spec.fileno())
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(_Server.socket_path())
        request = {"args": [str(a) for a in args], "env": dict(env if env is not None else os.environ),
                   "cwd": str(cwd or os.getcwd())}
        socket.send_fds(self._conn, [json.dumps(request).encode()], ends)
        for fd in to_close:
            os.close(fd)
        self.pid = json.loads(self._conn.recv(1 << 16))["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._read_end()
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._conn.setblocking(True)
        return self.returncode

    def _read_end(self) -> None:
        data = self._conn.recv(1 << 16)
        self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._read_end()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None and self.stdin is not None:
            self.stdin.write(input)
        if self.stdin is not None:
            self.stdin.close()
        out: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: out.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        return out.get("stdout"), out.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def bulkgen_process(args: list[str], **kwargs: Any) -> subprocess.Popen | ZygoteProcess:
    """`python -m bulkgen ARGS` as a process: forked from the server where it may be, else a plain subprocess."""
    env = kwargs.get("env")
    if usable(dict(env if env is not None else os.environ)):
        return ZygoteProcess([str(a) for a in args], **kwargs)
    return subprocess.Popen([sys.executable, "-m", "bulkgen", *map(str, args)], **kwargs)


def run_bulkgen(args: list[str], timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(["python", "-m", "bulkgen", *ARGS], capture_output=True, text=True), through the server."""
    proc = bulkgen_process(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
