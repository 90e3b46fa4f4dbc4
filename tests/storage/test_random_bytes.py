"""``storage.types.random_bytes`` and ``random_uuid``: bytes and version 4 UUIDs from a per-thread
buffer of ``os.urandom`` output; never repeated, also not by a forked child or by another thread."""

from __future__ import annotations

import os
import threading
import uuid

from storage.types import random_bytes, random_uuid


def test_ids_are_random_version_4_uuids_never_repeated():
    ids = [random_uuid() for _ in range(2_000)]  # several refills of the buffer
    assert all(isinstance(i, uuid.UUID) and i.version == 4 and i.variant == uuid.RFC_4122 for i in ids)
    assert len(set(ids)) == len(ids)


def test_an_id_is_what_the_uuid_constructor_makes_of_the_same_bytes(monkeypatch):
    """The value set directly equals ``uuid.UUID(bytes=..., version=4)`` of the bytes drawn: the
    same text, hash, version and variant, and it pickles and copies as any UUID."""
    import copy
    import pickle

    import storage.types

    for drawn in (b"\x00" * 16, b"\xff" * 16, os.urandom(16), os.urandom(16)):
        monkeypatch.setattr(storage.types, "random_bytes", lambda count, drawn=drawn: drawn)
        made, expected = random_uuid(), uuid.UUID(bytes=drawn, version=4)
        assert (made, str(made), hash(made), made.version, made.variant) == (
            expected,
            str(expected),
            hash(expected),
            4,
            uuid.RFC_4122,
        )
        assert pickle.loads(pickle.dumps(made)) == made == copy.deepcopy(made)  # noqa: S301 - our own bytes
        assert made.is_safe is uuid.SafeUUID.unknown


def test_threads_draw_from_buffers_of_their_own():
    found: list[uuid.UUID] = []
    lock = threading.Lock()

    def draw():
        mine = [random_uuid() for _ in range(500)]
        with lock:
            found.extend(mine)

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == len(found) == 2_000


def test_a_forked_child_does_not_repeat_the_ids_of_its_parent():
    random_uuid()  # the parent's buffer holds bytes the child inherits
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write, b"".join(random_uuid().bytes for _ in range(8)))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        raw = pipe.read()
    os.waitpid(child, 0)
    theirs = {uuid.UUID(bytes=raw[n : n + 16]) for n in range(0, len(raw), 16)}
    ours = {random_uuid() for _ in range(8)}
    assert len(theirs) == 8 and not theirs & ours


def test_random_bytes_are_handed_out_once():
    values = [random_bytes(12) for _ in range(1_000)]  # AES-GCM nonces: several refills of the buffer
    assert all(len(v) == 12 for v in values) and len(set(values)) == len(values)
    assert len(random_bytes(4096)) == 4096  # beyond the buffer: straight from os.urandom
