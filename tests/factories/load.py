"""A steady load on a platform's api, for the tests that change the platform under it (rolling restarts,
migrations): a mix of tokenize, token reads and network-token creates, every failed request recorded.
No tests here."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Load:
    """``clients`` clients sending requests at ``rate`` per second, all together, to ``base_url`` until
    :meth:`stop`: half ``POST /tokenize`` of ``card``, 30% ``GET /tokens/{id}`` of a recent token (of
    ``seeds`` at first), 20% ``POST /network-tokens`` of one of ``seeds``. Each client opens a connection
    per request. ``answers`` counts the answers per kind, ``failures`` lists each request that failed
    (no answer, or a status other than the kind's success), ``tokens`` and ``network_tokens`` the ids
    created."""

    base_url: str
    key: str
    seeds: list[str]
    card: dict
    rate: float = 50.0
    clients: int = 10
    answers: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    network_tokens: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        parts = urlsplit(self.base_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            headers = {"TS-API-KEY": self.key, "Connection": "close", "content-type": "application/json"}
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read() or b"{}")
        finally:
            conn.close()

    def _client(self, number: int) -> None:
        pace = self.clients / self.rate
        chooser = random.Random(number)
        next_at = time.monotonic() + chooser.random() * pace
        while not self._stop.is_set():
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += pace
            roll = chooser.random()
            with self._lock:
                known = list(self.tokens[-50:]) or self.seeds
            if roll < 0.5:
                kind, method, path, body, ok = "tokenize", "POST", "/tokenize", self.card, (201,)
            elif roll < 0.8:
                kind, method, path, body, ok = "read", "GET", f"/tokens/{chooser.choice(known)}", None, (200,)
            else:
                token = chooser.choice(self.seeds)
                kind, method, path, body, ok = (
                    "network token",
                    "POST",
                    "/network-tokens",
                    {"token_id": token},
                    (201, 202),
                )
            try:
                status, answer = self._request(method, path, body)
            except (OSError, http.client.HTTPException) as error:
                with self._lock:
                    self.failures.append(f"{kind}: {type(error).__name__}: {error}")
                continue
            with self._lock:
                self.answers[kind] += 1
                if status not in ok:
                    self.failures.append(f"{kind}: {status} {answer}")
                elif kind == "tokenize":
                    self.tokens.append(answer["id"])
                elif kind == "network token":
                    self.network_tokens.append(answer["id"])
