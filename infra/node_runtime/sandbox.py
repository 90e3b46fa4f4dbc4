"""How a customer's Node.js process is confined (ARCHITECTURE.md, security model).

Customer code (reactors, proxy code transforms) is hostile input. Each process runs inside
bubblewrap (``bwrap``, the sandbox Flatpak uses), with a seccomp filter made by libseccomp, around
the Node.js 22 runtime; Node's own permission model stays on inside as a second wall. What each part
of :func:`command` defends against:

* ``--unshare-user --disable-userns --uid 65534 --gid 65534 --cap-drop ALL``: a user namespace of
  its own in which the code is ``nobody`` with no capability, and may not make further user
  namespaces (so it cannot gain capabilities to undo the rest).
* ``--unshare-net``: a network namespace with only its own loopback. PostgreSQL, Redis, S3, the api,
  the cloud metadata address and every other address the host reaches are unreachable, and so are
  the host's abstract unix sockets (they belong to a network namespace). The one way out is the
  egress socket bound at ``/sandbox/egress.sock``: an HTTP CONNECT proxy in the worker
  (:mod:`infra.node_runtime.egress`) that connects only to public addresses (or the
  ``TESSERA_REACTOR_EGRESS_ALLOW`` pairs). ``runner.js`` routes ``fetch`` and the ``http``/``https``
  agents through it.
* ``--unshare-pid --as-pid-1 --new-session --unshare-ipc --unshare-uts --unshare-cgroup-try``: its
  own PID namespace (no other process of the host has a number in it) and session (no terminal to
  inject into), System V IPC, host name and cgroup view.
* ``--die-with-parent`` (and ``PR_SET_PDEATHSIG`` on bwrap itself): the process ends with the worker
  that started it, even when that worker is killed.
* Files: nothing of the host is visible but the Node.js executable and the shared libraries it
  loads, the runner, the code, its installed dependencies and the modules the platform ships, all
  read-only, plus ``/proc`` of its own PID namespace, a minimal ``/dev`` and a private ``/tmp``
  (tmpfs of ``TESSERA_REACTOR_TMP_MIB``, gone with the process). The data dir, the master key, the
  database's files and sockets and other reactors' code do not exist inside. ``node:sqlite`` is off
  (``--no-experimental-sqlite``); Node's ``--permission`` allows reads of ``/sandbox`` and writes to
  ``/tmp`` only, no child process, no worker thread, no native addon, no inspector.
* seccomp (:func:`seccomp_filter`): no signal to any process but itself (``kill``, ``tkill``,
  ``rt_sigqueueinfo`` and pidfd signalling refused; ``tgkill`` only to itself), no child process
  (``fork``, ``vfork`` and ``clone`` without ``CLONE_THREAD`` refused), no ptrace or cross-process
  memory access, no mount, namespace, BPF, perf, userfaultfd, keyring, module or io_uring calls.
* Limits (:func:`limits`, set on bwrap and inherited): writable memory (``RLIMIT_DATA``) and the V8
  heap per ``runtime.resources``, the largest file (``RLIMIT_FSIZE``, the size of ``/tmp``), open
  files (``RLIMIT_NOFILE``), no core dumps. Threads are bounded by construction (no fork, no
  worker threads, ``UV_THREADPOOL_SIZE`` and ``--v8-pool-size`` fixed). Time: each call has its
  timeout (the process is killed past it), and an idle process is frozen (``SIGSTOP``) between calls.
* Environment: built from nothing (never the platform's ``TESSERA_*``, ``AWS_*`` or anything else).

Where the sandbox cannot be made (bwrap or libseccomp missing, namespaces refused by the kernel or a
container's profile), :func:`availability` says why in one line and customer code does not run.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.node_runtime.binary import NodeInstallation, NodeNotFound, node_installation

#: The program every sandboxed process runs (``runner.js`` beside this module).
RUNNER = Path(__file__).resolve().parent / "runner.js"

MIB = 1024 * 1024
#: Where things are inside the sandbox.
INSIDE = Path("/sandbox")
INSIDE_NODE = INSIDE / "node"
INSIDE_RUNNER = INSIDE / "runner.js"
INSIDE_CODE = INSIDE / "code"
INSIDE_MODULES = INSIDE / "modules"
INSIDE_EGRESS = INSIDE / "egress.sock"
INSIDE_CA = INSIDE / "ca.pem"
#: The private, per-process tmpfs inside (no path of the host: S108 does not apply).
INSIDE_TMP = "/tmp"  # noqa: S108
#: The unprivileged user and group the code runs as inside its user namespace (``nobody``).
SANDBOX_UID = 65534
#: Open files of one process.
MAX_OPEN_FILES = 256
#: Threads of libuv's pool and of V8's platform in one process.
THREADS = 2


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be made on this host; the message says what is missing in one line."""


@dataclass(frozen=True)
class MemoryLimit:
    """A process's memory cap, in MiB: ``heap_mib`` for V8's old space, ``data_mib`` for all its
    writable memory (``RLIMIT_DATA``; heap, Buffers, native allocations and Node.js itself)."""

    heap_mib: int
    data_mib: int


@dataclass(frozen=True)
class NodeProgram:
    """One version of one tenant's customer code, as the pool runs it.

    ``key`` names the version and its owner (``<tenant>:<kind>:<id>:<version>``; processes are pooled
    by it and never serve another key); ``entry`` is the code's file on the host, which the runner
    loads once per process; ``node_modules`` its installed dependencies (None: none);
    ``module_paths`` directories of modules the platform ships (on ``NODE_PATH`` inside).
    ``timeout`` bounds a cold start and each invocation, in seconds; ``keep_warm`` is how many idle
    processes the pool keeps for this version (at least one).
    """

    key: str
    entry: Path
    timeout: float
    memory: MemoryLimit
    node_modules: Path | None = None
    module_paths: tuple[Path, ...] = ()
    keep_warm: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Confinement:
    """Where a pool's processes are confined: the ``bwrap`` executable, the egress proxy's socket
    (:mod:`infra.node_runtime.egress`) and the size of each process's private ``/tmp`` (MiB)."""

    bwrap: str
    egress_socket: Path
    tmp_mib: int = 16


# ---- seccomp -------------------------------------------------------------------------------------

#: System calls refused with EPERM whatever their arguments.
_REFUSED = (
    # signals to other processes (tgkill to itself stays allowed: abort() and raise() use it)
    "kill",
    "tkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "pidfd_send_signal",
    "pidfd_open",
    "pidfd_getfd",
    # child processes (clone is refused below unless it makes a thread)
    "fork",
    "vfork",
    # other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    # file systems and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "open_by_handle_at",
    "name_to_handle_at",
    # the kernel's own facilities
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "iopl",
    "ioperm",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "acct",
    "quotactl",
    "personality",
)
#: System calls answered ENOSYS, so that libc and libuv fall back to calls the filter can inspect.
_ABSENT = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
_CLONE_THREAD = 0x00010000
#: The code's own process id inside its PID namespace (``--as-pid-1``).
_OWN_PID = 1


@functools.cache
def seccomp_filter() -> bytes:
    """The BPF program bwrap loads before it starts Node.js (:data:`_REFUSED`, :data:`_ABSENT`,
    ``clone`` only with ``CLONE_THREAD``, ``tgkill`` only to itself). Raises
    :class:`SandboxUnavailable` when libseccomp cannot be loaded."""
    try:
        import pyseccomp as seccomp  # loads libseccomp.so through ctypes: only where a sandbox is made
    except (ImportError, OSError) as exc:
        raise SandboxUnavailable(f"libseccomp cannot be loaded ({exc}): apt-get install libseccomp2") from None
    refuse = seccomp.ERRNO(errno.EPERM)
    sandbox_filter = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in _REFUSED:
        sandbox_filter.add_rule(refuse, name)
    for name in _ABSENT:
        sandbox_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    sandbox_filter.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    sandbox_filter.add_rule(refuse, "tgkill", seccomp.Arg(0, seccomp.NE, _OWN_PID))
    with tempfile.TemporaryFile() as out:
        sandbox_filter.export_bpf(out)
        out.seek(0)
        return out.read()


def seccomp_fd() -> int:
    """A readable descriptor of :func:`seccomp_filter` for one bwrap (bwrap reads it; the caller
    closes it once bwrap started)."""
    program = seccomp_filter()
    read, write = os.pipe()
    os.write(write, program)  # a few hundred bytes: well within a pipe's buffer
    os.close(write)
    return read


# ---- the command line ----------------------------------------------------------------------------


@functools.cache
def _shared_libraries(node: Path) -> tuple[Path, ...]:
    """The shared libraries ``node`` loads (``ldd``), each as the path it is found at; the loader's
    directories when ``ldd`` cannot tell."""
    ldd = shutil.which("ldd")
    found: list[Path] = []
    if ldd:
        listing = subprocess.run([ldd, str(node)], capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
        for line in listing.stdout.splitlines():
            for word in line.split():
                if word.startswith("/") and Path(word).exists() and Path(word) not in found:
                    found.append(Path(word))
    if not found:
        found = [Path(p) for p in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if Path(p).exists()]
    return tuple(found)


def _bind(source: Path, inside: Path) -> list[str]:
    return ["--ro-bind", str(source), str(inside)]


def command(
    program: NodeProgram,
    node: NodeInstallation,
    *,
    bwrap: str,
    egress_socket: Path,
    seccomp: int,
    info: int,
    tmp_mib: int,
) -> list[str]:
    """The argv of a sandboxed process running ``program`` on ``node`` (see the module's text for
    what each flag defends against). ``seccomp`` and ``info`` are descriptors bwrap inherits: the
    filter to load and where it writes the process's host pid (``{"child-pid": N}``)."""
    libraries: list[str] = []
    for library in _shared_libraries(node.node):
        libraries += _bind(library, library)
    mounts = [
        *libraries,
        *_bind(node.node, INSIDE_NODE),
        *_bind(RUNNER, INSIDE_RUNNER),
        *_bind(program.entry, INSIDE_CODE / "index.js"),
    ]
    if program.node_modules is not None and program.node_modules.is_dir():
        mounts += _bind(program.node_modules, INSIDE_CODE / "node_modules")
    for index, path in enumerate(program.module_paths):
        mounts += _bind(path, INSIDE_MODULES / str(index))
    ca = os.environ.get("NODE_EXTRA_CA_CERTS")
    if ca and Path(ca).is_file():
        mounts += _bind(Path(ca), INSIDE_CA)
    return [
        bwrap,
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--as-pid-1",
        "--new-session",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        *mounts,
        "--bind",
        str(egress_socket),
        str(INSIDE_EGRESS),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmp_mib * MIB),
        "--tmpfs",
        INSIDE_TMP,
        "--chdir",
        str(INSIDE_CODE),
        "--clearenv",
        *[arg for name, value in environment(program).items() for arg in ("--setenv", name, value)],
        "--seccomp",
        str(seccomp),
        "--info-fd",
        str(info),
        "--",
        str(INSIDE_NODE),
        "--permission",
        f"--allow-fs-read={INSIDE}/",
        f"--allow-fs-read={INSIDE_TMP}/",
        f"--allow-fs-write={INSIDE_TMP}/",
        "--no-addons",
        "--no-experimental-sqlite",
        f"--v8-pool-size={THREADS}",
        f"--max-old-space-size={program.memory.heap_mib}",
        str(INSIDE_RUNNER),
        str(INSIDE_CODE / "index.js"),
        str(INSIDE_EGRESS),
    ]


def environment(program: NodeProgram) -> dict[str, str]:
    """The whole environment of a sandboxed process (bwrap clears its own and sets this one with
    ``--setenv``: nothing of the worker's environment reaches the code)."""
    env = {
        "NODE_ENV": "production",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "HOME": INSIDE_TMP,
        "TMPDIR": INSIDE_TMP,
        "UV_THREADPOOL_SIZE": str(THREADS),
        "NODE_PATH": os.pathsep.join(str(INSIDE_MODULES / str(i)) for i in range(len(program.module_paths))),
        **program.extra_env,
    }
    ca = os.environ.get("NODE_EXTRA_CA_CERTS")
    if ca and Path(ca).is_file():
        env["NODE_EXTRA_CA_CERTS"] = str(INSIDE_CA)
    return env


_PR_SET_PDEATHSIG = 1


def limits(memory: MemoryLimit, *, tmp_mib: int) -> Callable[[], None]:
    """The function run in the child between fork and exec of bwrap (inherited by Node.js): caps
    its writable memory at ``memory.data_mib``, its largest file at ``tmp_mib``, its open files at
    :data:`MAX_OPEN_FILES`, forbids core dumps, and makes the kernel kill it when the worker dies."""
    data = memory.data_mib * MIB
    largest = tmp_mib * MIB

    def apply() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest, largest))
        resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return apply


# ---- availability --------------------------------------------------------------------------------


def _bwrap_path(bwrap: str) -> str:
    found = shutil.which(bwrap)
    if found is None:
        raise SandboxUnavailable(
            f"bubblewrap ({bwrap}) is not installed: apt-get install bubblewrap, or set TESSERA_REACTOR_BWRAP"
        )
    return found


@functools.cache
def _probe(bwrap: str) -> str | None:
    """None when a sandboxed Node.js starts with this bwrap here; else the one-line reason."""
    try:
        path = _bwrap_path(bwrap)
        node = node_installation()
        seccomp_filter()
    except (SandboxUnavailable, NodeNotFound) as exc:
        return str(exc)
    with tempfile.TemporaryDirectory(prefix="tessera-probe-") as folder:
        entry = Path(folder) / "index.js"
        entry.write_text("module.exports = async () => null;\n")
        socket_path = Path(folder) / "egress.sock"
        socket_path.touch()
        program = NodeProgram(key="probe", entry=entry, timeout=10.0, memory=MemoryLimit(64, 512))
        filter_fd = seccomp_fd()
        info_read, info_write = os.pipe()
        try:
            argv = command(
                program, node, bwrap=path, egress_socket=socket_path, seccomp=filter_fd, info=info_write, tmp_mib=1
            )
            argv[-3:] = ["-e", "process.exit(0)"]  # the runner, code and socket: a bare start is the probe
            completed = subprocess.run(  # noqa: S603 - our own argv, no shell
                argv,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
                env={},
                pass_fds=(filter_fd, info_write),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap could not start a sandboxed process ({exc})"
        finally:
            for fd in (filter_fd, info_read, info_write):
                os.close(fd)
    if completed.returncode != 0:
        said = (completed.stderr.strip().splitlines() or [f"exit status {completed.returncode}"])[-1]
        return (
            f"bubblewrap cannot make the sandbox here ({said}): the kernel or the container must allow "
            "user and network namespaces"
        )
    return None


def availability(bwrap: str) -> str | None:
    """None when customer code can run sandboxed on this host (checked once per process by starting
    one sandboxed Node.js); else one line naming what is missing."""
    return _probe(bwrap)


def require_sandbox(bwrap: str) -> None:
    """Raise :class:`SandboxUnavailable` (one line) unless :func:`availability` is None."""
    reason = availability(bwrap)
    if reason is not None:
        raise SandboxUnavailable(reason)
