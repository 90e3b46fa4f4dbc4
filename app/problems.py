"""Rendering :class:`infra.errors.Problem` as an aiohttp response (``application/problem+json``)."""

from __future__ import annotations

import json

from aiohttp import web

from domain.tokens.cards import mask_card_numbers
from infra.errors import Problem

PROBLEM_CONTENT_TYPE = "application/problem+json"


def problem_response(problem: Problem, instance: str | None = None) -> web.Response:
    """The problem as a response with its status and headers. A card number the client sent (in the
    path, or as a refused value a message repeats) is masked: problems never carry one."""
    return web.Response(
        status=problem.status,
        text=mask_card_numbers(json.dumps(problem.body(instance))),
        content_type=PROBLEM_CONTENT_TYPE,
        headers=problem.headers,
    )
