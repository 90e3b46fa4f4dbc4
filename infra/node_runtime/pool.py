"""A pool of warm sandboxed Node.js processes, one or more per version of customer code.

A process loads its code once and then serves invocations one at a time. After a call it goes back
to the pool if fewer than ``program.keep_warm`` processes of that version are idle; otherwise it
ends. A call that finds no idle process starts one (a cold start): concurrent calls beyond the warm
ones fan out to cold starts (core spec section 8, reactor hot concurrency). A process that times
out, crashes or breaks the protocol is killed and never reused; the next call starts a fresh one,
so the pool itself survives whatever the code does. ``max_idle`` bounds the idle processes of all
versions together: past it, the least recently used version's idle processes end. A pool inherited
through ``fork`` (a Celery prefork child) starts empty in the child: the parent's processes and their
pipes stay the parent's.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict

from infra.node_runtime.binary import NodeInstallation, node_installation
from infra.node_runtime.process import NodeProcess, NodeRuntimeError, Outcome
from infra.node_runtime.sandbox import NodeProgram


class NodePool:
    """Warm processes by ``NodeProgram.key``; thread-safe.

    ``node`` defaults to this machine's Node.js 22 (:func:`node_installation`, which raises
    ``NodeNotFound`` when there is none).
    """

    def __init__(self, *, max_idle: int = 32, node: NodeInstallation | None = None):
        self.max_idle = max_idle
        self.node = node or node_installation()
        self._idle: OrderedDict[str, list[NodeProcess]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._retired: set[str] = set()
        self._owner = os.getpid()
        #: Processes started per program key (each one loaded the code once).
        self.started: Counter[str] = Counter()

    def invoke(self, program: NodeProgram, payload: object) -> Outcome:
        """Run ``program`` once on ``payload`` (anything JSON): what the code returned or threw.

        Raises ``CodeLoadError`` (the code does not load or exports no function), ``InvocationTimeout``
        (no answer within ``program.timeout`` seconds: the process is killed) or ``ProcessEnded``.
        """
        process = self._checkout(program)
        outcome = process.call(payload)  # on NodeRuntimeError the process is already killed
        self._checkin(program, process)
        return outcome

    def warm(self, program: NodeProgram) -> int:
        """Start processes of ``program`` until ``keep_warm`` of them are idle; returns how many
        are idle then. Raises like :meth:`invoke` when the code does not load."""
        for _ in range(max(1, program.keep_warm) - self.idle(program.key)):
            self._checkin(program, self._start(program))
        return self.idle(program.key)

    def idle(self, key: str) -> int:
        """How many live processes of ``key`` are idle now."""
        return len(self.pids(key))

    def pids(self, key: str) -> list[int]:
        """The process ids of the live idle processes of ``key``."""
        with self._lock:
            return [p.pid for p in self._idle.get(key, []) if p.alive]

    def retire(self, key: str) -> None:
        """End the processes of ``key`` (a version replaced or deleted): the idle ones now, the
        busy ones when their call returns. A later call of ``key`` starts it afresh."""
        with self._lock:
            self._retired.add(key)
            processes = self._idle.pop(key, [])
        for process in processes:
            process.kill()

    def close(self) -> None:
        """End every idle process; processes busy now end when their call returns."""
        with self._lock:
            self._closed = True
            processes = [p for group in self._idle.values() for p in group]
            self._idle.clear()
        for process in processes:
            process.kill()

    def _start(self, program: NodeProgram) -> NodeProcess:
        process = NodeProcess(program, self.node)
        with self._lock:
            self.started[program.key] += 1
            self._retired.discard(program.key)
        process.wait_ready()
        return process

    def _checkout(self, program: NodeProgram) -> NodeProcess:
        if self._owner != os.getpid():
            self._forget_inherited()
        with self._lock:
            group = self._idle.get(program.key, [])
            while group:
                process = group.pop()
                if process.alive:
                    return process
                process.kill()  # reap one that died while idle
        return self._start(program)

    def _forget_inherited(self) -> None:
        """In a forked child: drop the parent's processes without touching them."""
        self._lock = threading.Lock()  # the parent may have held it at the fork
        with self._lock:
            self._idle.clear()
            self._owner = os.getpid()

    def _checkin(self, program: NodeProgram, process: NodeProcess) -> None:
        evicted: list[NodeProcess] = []
        with self._lock:
            group = self._idle.setdefault(program.key, [])
            self._idle.move_to_end(program.key)
            if self._closed or program.key in self._retired or len(group) >= max(1, program.keep_warm):
                evicted.append(process)
            else:
                group.append(process)
            total = sum(len(g) for g in self._idle.values())
            while total > self.max_idle:
                key, oldest = next(iter(self._idle.items()))
                if oldest:
                    evicted.append(oldest.pop(0))
                    total -= 1
                if not oldest:
                    del self._idle[key]
        for gone in evicted:
            gone.kill()


__all__ = ["NodePool", "NodeRuntimeError"]
