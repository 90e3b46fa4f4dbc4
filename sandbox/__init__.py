"""Tessera's sandbox providers: simulated card networks and agentic payment providers.

Test tenants' provider calls go over HTTP to this small aiohttp server on loopback. Its behaviour
is decided by the card number alone (``spec/SANDBOX.md``); the HTTP API is in ``README.md`` beside
this file. Entry points: :func:`sandbox.app.make_app` and :func:`sandbox.app.run`.
"""

from sandbox.app import make_app, run

__all__ = ["make_app", "run"]
