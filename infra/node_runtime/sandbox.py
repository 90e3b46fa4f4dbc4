"""How a customer's Node.js process is confined (ARCHITECTURE.md, security model).

* **Files**: Node's permission model (``--permission``): the process may read only the runner, the
  code's own directory, its installed dependencies and the modules the platform ships; it may write
  nowhere, start no child process, no worker thread, load no native addon, and open no inspector.
* **Environment**: a clean one, built here from nothing (never the platform's ``TESSERA_*``, ``AWS_*``
  or any other variable): ``NODE_PATH`` for the shipped modules, ``NODE_ENV``, ``TZ``, ``LANG``,
  ``HOME`` (the code's directory) and, when the platform has it, ``NODE_EXTRA_CA_CERTS`` (a path to
  public CA certificates, so outbound HTTPS trusts what the platform trusts).
* **Working directory**: the code's own directory.
* **Memory**: the V8 heap capped by ``--max-old-space-size``, and the whole process's writable data
  (heap, buffers, native allocations) by ``RLIMIT_DATA`` set between fork and exec. ``RLIMIT_AS``
  cannot be used: V8 reserves gigabytes of address space at start (its pointer cage) and Node.js
  aborts at once under any useful address-space limit.
* **Network**: left open. Reactors call payment service providers (core spec, reactors), so
  outbound ``fetch`` works.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.node_runtime.binary import NodeInstallation

#: The program every sandboxed process runs (``runner.js`` beside this module).
RUNNER = Path(__file__).resolve().parent / "runner.js"

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryLimit:
    """A process's memory cap, in MiB: ``heap_mib`` for V8's old space, ``data_mib`` for all its
    writable memory (``RLIMIT_DATA``; heap, Buffers, native allocations and Node.js itself)."""

    heap_mib: int
    data_mib: int


@dataclass(frozen=True)
class NodeProgram:
    """One version of customer code, as the pool runs it.

    ``key`` names the version (processes are pooled by it); ``entry`` is the code's file, which the
    runner loads once per process; ``workdir`` its own directory (working directory and ``HOME``);
    ``readable`` the further directories it may read (its installed ``node_modules``); ``module_paths``
    the directories on ``NODE_PATH`` (modules the platform ships, readable too). ``timeout`` bounds a
    cold start and each invocation, in seconds; ``keep_warm`` is how many idle processes the pool
    keeps for this version (at least one).
    """

    key: str
    entry: Path
    workdir: Path
    timeout: float
    memory: MemoryLimit
    readable: tuple[Path, ...] = ()
    module_paths: tuple[Path, ...] = ()
    keep_warm: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)


def _read_grants(paths: list[Path]) -> list[str]:
    grants: list[str] = []
    for path in paths:
        for form in (path.absolute(), path.resolve()):  # the name used, and where a symlink leads
            flag = f"--allow-fs-read={form}"
            if flag not in grants:
                grants.append(flag)
    return grants


def command(program: NodeProgram, node: NodeInstallation) -> list[str]:
    """The argv of a sandboxed process running ``program`` on ``node``."""
    readable = [RUNNER, program.workdir, *program.readable, *program.module_paths]
    return [
        str(node.node),
        "--permission",
        *_read_grants(readable),
        "--no-addons",
        f"--max-old-space-size={program.memory.heap_mib}",
        str(RUNNER),
        str(program.entry),
    ]


def environment(program: NodeProgram) -> dict[str, str]:
    """The whole environment of a sandboxed process (nothing inherited but the CA bundle's path)."""
    env = {
        "NODE_ENV": "production",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "HOME": str(program.workdir),
        "NODE_PATH": os.pathsep.join(str(p) for p in program.module_paths),
        **program.extra_env,
    }
    if os.environ.get("NODE_EXTRA_CA_CERTS"):
        env["NODE_EXTRA_CA_CERTS"] = os.environ["NODE_EXTRA_CA_CERTS"]
    return env


def limits(memory: MemoryLimit) -> Callable[[], None]:
    """The function run in the child between fork and exec: caps its writable memory at
    ``memory.data_mib``, forbids core dumps and file writes (``RLIMIT_FSIZE`` 0)."""
    data = memory.data_mib * MIB

    def apply() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    return apply
