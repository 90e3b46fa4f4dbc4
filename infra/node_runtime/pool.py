"""A pool of warm sandboxed Node.js processes, one or more per version of one tenant's customer code.

A process loads its code once and then serves invocations one at a time. Its key names the tenant
and the version (``NodeProgram.key``): a process never serves another key, so two tenants never
share a process, even for the same code. After a call it goes back to the pool, frozen
(``SIGSTOP``), if fewer than ``program.keep_warm`` processes of that version are idle and the code
left no timer running; otherwise it ends. A call that finds no idle process starts one (a cold
start): concurrent calls beyond the warm ones fan out to cold starts (reactor hot concurrency). A
process that times out, crashes or breaks the protocol is killed and never reused; the next call
starts a fresh one, so the pool itself survives whatever the code does.

Bounds: ``max_idle`` idle processes of all versions together (past it, the least recently used
version's idle processes end); an idle process ends after ``idle_seconds`` (a reaper thread looks
every few seconds). :meth:`NodePool.retire` / :func:`retire_everywhere` end a version's or a
tenant's processes at once (deleted or updated code; the worker's broadcast command calls the
latter). A pool inherited through ``fork`` (a Celery prefork child) starts empty in the child, with
its own egress proxy: the parent's processes and their pipes stay the parent's.

Every process is confined (:mod:`infra.node_runtime.sandbox`); where the sandbox cannot be made,
:meth:`NodePool.invoke` raises :class:`~infra.node_runtime.sandbox.SandboxUnavailable` and nothing
runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from infra.node_runtime import sandbox
from infra.node_runtime.binary import NodeInstallation, node_installation
from infra.node_runtime.egress import EgressProxy
from infra.node_runtime.process import NodeProcess, NodeRuntimeError, Outcome
from infra.node_runtime.sandbox import NodeProgram

log = logging.getLogger("tessera.node_runtime")

_POOLS: weakref.WeakSet[NodePool] = weakref.WeakSet()
#: How often (seconds) the reaper asks whether the owners of live processes still exist.
OWNER_CHECK_SECONDS = 3.0


@dataclass
class _Idle:
    process: NodeProcess
    since: float


class NodePool:
    """Warm processes by ``NodeProgram.key``; thread-safe.

    ``node`` defaults to this machine's Node.js 22 (:func:`node_installation`, which raises
    ``NodeNotFound`` when there is none). ``bwrap``: the bubblewrap executable; ``egress_allow``:
    ``host:port`` pairs customer code may reach although not public; ``tmp_mib``: each process's
    private ``/tmp``; ``idle_seconds``: how long an idle process is kept. ``owner_check``: given the
    keys with processes, the keys whose owner is gone; the reaper asks it every
    :data:`OWNER_CHECK_SECONDS` and retires those keys.
    """

    def __init__(
        self,
        *,
        max_idle: int = 32,
        node: NodeInstallation | None = None,
        bwrap: str = "bwrap",
        egress_allow: frozenset[str] = frozenset(),
        tmp_mib: int = 16,
        idle_seconds: float = 300.0,
        owner_check: Callable[[set[str]], set[str]] | None = None,
    ):
        self.max_idle = max_idle
        self.owner_check = owner_check
        self.node = node or node_installation()
        self.bwrap = bwrap
        self.egress_allow = egress_allow
        self.tmp_mib = tmp_mib
        self.idle_seconds = idle_seconds
        self._idle: OrderedDict[str, list[_Idle]] = OrderedDict()
        self._busy: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False
        self._retired: set[str] = set()
        self._owner = os.getpid()
        self._egress: EgressProxy | None = None
        self._reaper: threading.Thread | None = None
        #: Processes started per program key (each one loaded the code once).
        self.started: Counter[str] = Counter()
        _POOLS.add(self)

    # ---- calls -----------------------------------------------------------------------------------

    def invoke(self, program: NodeProgram, payload: object) -> Outcome:
        """Run ``program`` once on ``payload`` (anything JSON): what the code returned or threw.

        Raises ``SandboxUnavailable`` (customer code cannot be confined here: nothing runs),
        ``CodeLoadError`` (the code does not load or exports no function), ``InvocationTimeout``
        (no answer within ``program.timeout`` seconds: the process is killed) or ``ProcessEnded``.
        """
        process = self._checkout(program)
        try:
            outcome = process.call(payload)  # on NodeRuntimeError the process is already killed
        finally:
            with self._lock:
                self._busy[program.key] -= 1
        self._checkin(program, process, reusable=outcome.timers == 0)
        return outcome

    def warm(self, program: NodeProgram) -> int:
        """Start processes of ``program`` until ``keep_warm`` of them are idle; returns how many
        are idle then. Raises like :meth:`invoke` when the code does not load."""
        for _ in range(max(1, program.keep_warm) - self.idle(program.key)):
            process = self._start(program)
            self._checkin(program, process, reusable=True)
        return self.idle(program.key)

    def load(self, program: NodeProgram) -> None:
        """Start one process of ``program``, let it load the code, and end it (a build's check that
        the code can run at all). Raises like :meth:`invoke` when the code does not load or does not
        load within ``program.timeout`` seconds."""
        if self._owner != os.getpid():
            self._forget_inherited()
        self._start(program).kill()

    # ---- what runs -------------------------------------------------------------------------------

    def idle(self, key: str) -> int:
        """How many live processes of ``key`` are idle now."""
        return len(self.pids(key))

    def pids(self, key: str) -> list[int]:
        """The host process ids (bwrap's) of the live idle processes of ``key``."""
        with self._lock:
            return [entry.process.pid for entry in self._idle.get(key, []) if entry.process.alive]

    def node_pids(self, key: str) -> list[int]:
        """The host process ids of the Node.js processes (inside their sandboxes) idle for ``key``."""
        with self._lock:
            return [e.process.node_pid for e in self._idle.get(key, []) if e.process.alive and e.process.node_pid]

    def keys(self) -> set[str]:
        """The keys with an idle or a busy process now."""
        with self._lock:
            return {key for key, group in self._idle.items() if group} | {k for k, n in self._busy.items() if n > 0}

    @property
    def egress(self) -> EgressProxy:
        """This process's egress proxy (started on first use, again after a fork)."""
        with self._lock:
            if self._egress is None:
                self._egress = EgressProxy(allow=self.egress_allow)
            return self._egress

    # ---- ending processes ------------------------------------------------------------------------

    def retire(self, key: str) -> None:
        """End the processes of ``key`` (a version replaced or deleted): the idle ones now, the
        busy ones when their call returns. A later call of ``key`` starts it afresh."""
        with self._lock:
            self._retired.add(key)
            entries = self._idle.pop(key, [])
        for entry in entries:
            entry.process.kill()

    def retire_matching(self, prefix: str) -> int:
        """:meth:`retire` every key starting with ``prefix`` (a tenant's, or one reactor's or
        proxy's versions); returns how many keys."""
        matching = [key for key in self.keys() if key.startswith(prefix)]
        for key in matching:
            self.retire(key)
        return len(matching)

    def reap(self, now: float | None = None) -> int:
        """End the processes idle for longer than ``idle_seconds`` and those that died; how many."""
        now = time.monotonic() if now is None else now
        gone: list[NodeProcess] = []
        with self._lock:
            for key in list(self._idle):
                keep: list[_Idle] = []
                for entry in self._idle[key]:
                    if now - entry.since > self.idle_seconds or not entry.process.alive:
                        gone.append(entry.process)
                    else:
                        keep.append(entry)
                if keep:
                    self._idle[key] = keep
                else:
                    del self._idle[key]
        for process in gone:
            process.kill()
        return len(gone)

    def close(self) -> None:
        """End every idle process and the egress proxy; processes busy now end when their call returns."""
        with self._lock:
            self._closed = True
            entries = [entry for group in self._idle.values() for entry in group]
            self._idle.clear()
            egress, self._egress = self._egress, None
        for entry in entries:
            entry.process.kill()
        if egress is not None:
            egress.close()

    # ---- internals -------------------------------------------------------------------------------

    def _confinement(self) -> sandbox.Confinement:
        sandbox.require_sandbox(self.bwrap)
        return sandbox.Confinement(bwrap=self.bwrap, egress_socket=self.egress.path, tmp_mib=self.tmp_mib)

    def _start(self, program: NodeProgram) -> NodeProcess:
        process = NodeProcess(program, self.node, self._confinement())
        with self._lock:
            self.started[program.key] += 1
            self._retired.discard(program.key)
        process.wait_ready()
        self._ensure_reaper()
        return process

    def _checkout(self, program: NodeProgram) -> NodeProcess:
        if self._owner != os.getpid():
            self._forget_inherited()
        with self._lock:
            self._busy[program.key] += 1
            group = self._idle.get(program.key, [])
            while group:
                entry = group.pop()
                if entry.process.alive:
                    entry.process.thaw()
                    return entry.process
                entry.process.kill()  # reap one that died while idle
        try:
            return self._start(program)
        except BaseException:
            with self._lock:
                self._busy[program.key] -= 1
            raise

    def _forget_inherited(self) -> None:
        """In a forked child: drop the parent's processes and egress proxy without touching them."""
        self._lock = threading.Lock()  # the parent may have held it at the fork
        with self._lock:
            self._idle.clear()
            self._busy.clear()
            self._egress = None
            self._reaper = None
            self._owner = os.getpid()

    def _checkin(self, program: NodeProgram, process: NodeProcess, *, reusable: bool) -> None:
        evicted: list[NodeProcess] = []
        with self._lock:
            group = self._idle.setdefault(program.key, [])
            self._idle.move_to_end(program.key)
            if not reusable or self._closed or program.key in self._retired or len(group) >= max(1, program.keep_warm):
                evicted.append(process)
            else:
                process.freeze()
                group.append(_Idle(process, time.monotonic()))
            total = sum(len(g) for g in self._idle.values())
            while total > self.max_idle:
                key, oldest = next(iter(self._idle.items()))
                if oldest:
                    evicted.append(oldest.pop(0).process)
                    total -= 1
                if not oldest:
                    del self._idle[key]
            if not group and program.key in self._idle:
                del self._idle[program.key]
        for gone in evicted:
            gone.kill()

    def _ensure_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._reaper = threading.Thread(target=self._reap_forever, name="tessera-node-reaper", daemon=True)
            self._reaper.start()

    def _reap_forever(self) -> None:
        pause = max(0.5, min(OWNER_CHECK_SECONDS, self.idle_seconds / 2))
        while not self._closed and self._owner == os.getpid():
            time.sleep(pause)
            self.reap()
            self.check_owners()

    def check_owners(self) -> int:
        """Retire the keys whose owner ``owner_check`` says is gone; how many. A failing check
        (the database away) retires nothing and is tried again at the next round."""
        keys = self.keys()
        if self.owner_check is None or not keys:
            return 0
        try:
            gone = self.owner_check(keys)
        except Exception:  # the reaper must outlive a database outage
            log.warning("the owner check of customer code's processes failed", exc_info=True)
            return 0
        for key in gone:
            self.retire(key)
        return len(gone)


def retire_everywhere(prefix: str) -> int:
    """End, in every pool of this process, the processes whose key starts with ``prefix``; how many
    keys were retired. The worker's broadcast command (``tessera_end_code``) calls it."""
    return sum(pool.retire_matching(prefix) for pool in list(_POOLS))


__all__ = ["NodePool", "NodeRuntimeError", "retire_everywhere"]
