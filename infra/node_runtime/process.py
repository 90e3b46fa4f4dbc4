"""One sandboxed Node.js process running one version of customer code, fed over a pipe.

The protocol (``runner.js``): newline-delimited JSON on the child's stdin and stdout. The child
writes ``{"ready": true}`` once the code is loaded (or ``{"load_error": ...}`` and exits); then each
``{"id", "payload"}`` line written to it gets one ``{"id", "ok", "value" | "error"}`` line back. The
parent reads and writes with deadlines (``poll`` on non-blocking pipes), so code that loops forever,
stops reading or never answers is found out at its timeout and killed.

The process runs inside bubblewrap (:mod:`infra.node_runtime.sandbox`); bwrap tells the host pid of
the Node.js process on its info descriptor, so the pool can freeze it (``SIGSTOP``) while it is idle
and thaw it (``SIGCONT``) for its next call: customer code never runs between invocations.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from infra.node_runtime import sandbox
from infra.node_runtime.binary import NodeInstallation

#: The largest answer line read from a process (bytes); a longer one ends the process.
MAX_FRAME_BYTES = 16 * 1024 * 1024


class NodeRuntimeError(Exception):
    """An invocation did not produce an answer of the code."""


class InvocationTimeout(NodeRuntimeError):
    """The code did not load or answer within its timeout; its process was killed."""

    def __init__(self, timeout: float):
        super().__init__(f"no answer within {timeout:g} s")
        self.timeout = timeout


class ProcessEnded(NodeRuntimeError):
    """The process ended (out of memory, ``process.exit``, a crash) or broke the protocol."""

    def __init__(self, detail: str, returncode: int | None = None):
        super().__init__(detail)
        self.returncode = returncode


class CodeLoadError(NodeRuntimeError):
    """The code does not load (``kind`` ``syntax`` or ``load``) or exports no function
    (``kind`` ``not_a_function``); ``name`` and ``message`` are those of the error Node.js raised,
    ``line`` the line of the code a syntax error is on (None when unknown)."""

    def __init__(self, kind: str, name: str, message: str, line: int | None = None):
        super().__init__(f"{kind}: {name}: {message}")
        self.kind, self.name, self.message, self.line = kind, name, message, line


@dataclass(frozen=True)
class Returned:
    """The code's function returned ``value`` (JSON: dict, list, str, number, bool or None).
    ``timers``: timers the code left running when it answered (the process is then not reused)."""

    value: object
    timers: int = 0


@dataclass(frozen=True)
class Thrown:
    """The code's function threw. ``marked`` errors are instances of the classes the platform ships
    (their ``message`` and ``errors`` are meant for the caller); of any other thrown value the
    ``name`` and the first line of its message are known (at most 500 characters, every string of
    the request it quoted replaced by ``[redacted]``: ``runner.js``)."""

    name: str
    message: str | None
    errors: object
    marked: bool
    timers: int = 0


Outcome = Returned | Thrown


class NodeProcess:
    """A started process of ``program``; :meth:`wait_ready` before the first :meth:`call`.

    Not thread-safe: the pool hands a process to one caller at a time.
    """

    def __init__(self, program: sandbox.NodeProgram, node: NodeInstallation, confinement: sandbox.Confinement):
        self.program = program
        seccomp = sandbox.seccomp_fd()
        info_read, info_write = os.pipe()
        try:
            self.popen = subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                sandbox.command(
                    program,
                    node,
                    bwrap=confinement.bwrap,
                    egress_socket=confinement.egress_socket,
                    seccomp=seccomp,
                    info=info_write,
                    tmp_mib=confinement.tmp_mib,
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={},  # bwrap sets the code's own (``sandbox.environment``) inside
                preexec_fn=sandbox.limits(program.memory, tmp_mib=confinement.tmp_mib),
                pass_fds=(seccomp, info_write),
                bufsize=0,
            )
        finally:
            os.close(seccomp)
            os.close(info_write)
        self._info: int | None = info_read
        #: The host pid of the Node.js process (bwrap's ``child-pid``), once known.
        self.node_pid: int | None = None
        self.frozen = False
        assert self.popen.stdin is not None and self.popen.stdout is not None, "Popen made with stdin=stdout=PIPE"
        self._in = self.popen.stdin.fileno()
        self._out = self.popen.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self._reader = select.poll()
        self._reader.register(self._out, select.POLLIN)
        self._writer = select.poll()
        self._writer.register(self._in, select.POLLOUT)
        self._buffer = bytearray()
        self._last_id = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def wait_ready(self) -> None:
        """Wait until the code is loaded, within the program's timeout.

        Raises :class:`CodeLoadError`, :class:`InvocationTimeout` or :class:`ProcessEnded` (the
        process is killed in each case).
        """
        deadline = time.monotonic() + self.program.timeout
        self._guarded(self._read_info, deadline)
        frame = self._guarded(self._read_frame, deadline)
        if frame.get("ready") is True:
            return
        self.kill()
        error = frame.get("load_error")
        if isinstance(error, dict):
            line = error.get("line")
            raise CodeLoadError(
                str(error.get("kind")),
                str(error.get("name")),
                str(error.get("message")),
                line if isinstance(line, int) else None,
            )
        raise ProcessEnded("the process broke the protocol at start")

    def call(self, payload: object) -> Outcome:
        """Run the code once on ``payload`` (anything JSON) within the program's timeout.

        Raises :class:`InvocationTimeout` or :class:`ProcessEnded` (the process is then killed).
        """
        self._last_id += 1
        deadline = time.monotonic() + self.program.timeout
        line = json.dumps({"id": self._last_id, "payload": payload}, separators=(",", ":")).encode() + b"\n"
        self._guarded(self._write, line, deadline)
        frame = self._guarded(self._read_frame, deadline)
        if frame.get("id") != self._last_id or not isinstance(frame.get("ok"), bool):
            self.kill()
            raise ProcessEnded("the process broke the protocol")
        timers = frame.get("timers") if isinstance(frame.get("timers"), int) else 0
        if frame["ok"]:
            return Returned(frame.get("value"), timers)
        error = frame.get("error") if isinstance(frame.get("error"), dict) else {}
        return Thrown(
            name=str(error.get("name") or "Error"),
            message=error.get("message") if isinstance(error.get("message"), str) else None,
            errors=error.get("errors"),
            marked=error.get("marked") is True,
            timers=timers,
        )

    def freeze(self) -> None:
        """Stop the Node.js process (``SIGSTOP``) until :meth:`thaw`: no code runs while it is idle."""
        if self.node_pid is not None and not self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.node_pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        """Let a frozen process run again (``SIGCONT``)."""
        if self.node_pid is not None and self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.node_pid, signal.SIGCONT)
            self.frozen = False

    def kill(self) -> None:
        """End the process at once and reap it: SIGKILL to Node.js (frozen or not) while bwrap, its
        parent, still runs (so the pid cannot have been reused), then to bwrap."""
        if self.node_pid is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.node_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is None:
                continue
            with contextlib.suppress(OSError):
                pipe.close()
        if self._info is not None:
            with contextlib.suppress(OSError):
                os.close(self._info)
            self._info = None

    def _read_info(self, deadline: float) -> None:
        """Read bwrap's ``{"child-pid": N}`` (written once the sandbox is made, then closed)."""
        info = self._info
        if info is None:
            raise RuntimeError("bwrap's info pipe was already read")
        data = b""
        poller = select.poll()
        poller.register(info, select.POLLIN)
        while True:
            self._wait(poller, deadline)
            chunk = os.read(info, 4096)
            if not chunk:
                break
            data += chunk
        os.close(info)
        self._info = None
        try:
            pid = json.loads(data)["child-pid"]
        except (ValueError, KeyError, TypeError):
            raise self._ended() from None
        self.node_pid = int(pid)

    def _guarded(self, step, *args):
        try:
            return step(*args)
        except NodeRuntimeError:
            self.kill()
            raise

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._in, view)
            except BlockingIOError:
                written = 0
            except BrokenPipeError:
                raise self._ended() from None
            view = view[written:]
            if view:
                self._wait(self._writer, deadline)

    def _read_frame(self, deadline: float) -> dict:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                try:
                    frame = json.loads(line)
                except ValueError:
                    raise ProcessEnded("the process wrote something that is not a protocol line") from None
                if not isinstance(frame, dict):
                    raise ProcessEnded("the process wrote something that is not a protocol line")
                return frame
            if len(self._buffer) > MAX_FRAME_BYTES:
                raise ProcessEnded(f"the answer is larger than {MAX_FRAME_BYTES} bytes")
            self._wait(self._reader, deadline)
            try:
                chunk = os.read(self._out, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise self._ended()
            self._buffer += chunk

    def _wait(self, poller: select.poll, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            if time.monotonic() >= deadline:
                raise InvocationTimeout(self.program.timeout)

    def _ended(self) -> ProcessEnded:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(1)
        code = self.popen.returncode
        return ProcessEnded(f"the process ended (exit status {code})", code)
