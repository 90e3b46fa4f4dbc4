"""The invitation page a person opens from the invitation mail: ``/invitations/join?token=``.

``GET`` shows which tenant the link invites to and with which role, and a form (the invitee's first
and last name, a button) that ``POST``s the token to the same path; the post accepts the invitation
exactly as ``POST /invitations/accept`` does (``domain.tenancy.invitations.accept_invitation``) and
answers a page saying so. An unknown, used, superseded, withdrawn or expired link answers a page
with the same status and reason as the JSON endpoints (404, 410, 409).

The pages load nothing (no script, no external style): ``Content-Security-Policy`` allows inline
style and form posts to this origin only, framing is refused (a hidden frame cannot click the
button) and no referrer is sent (the address holds the token).
"""

from __future__ import annotations

import html

from aiohttp import web

from app.api import Api, Call, run_db
from domain.tenancy import invitations
from infra.errors import Problem

api = Api()
TAG = "Tenant invitations"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_NAME_MAX = 100
_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:32rem;margin:3rem auto;padding:0 1rem;color:#1d2330}"
    "label{display:block;margin:.8rem 0 .2rem}input{width:100%;padding:.4rem;font-size:1rem}"
    "button{margin-top:1.2rem;padding:.6rem 1.4rem;font-size:1rem;cursor:pointer}"
    ".role{font-weight:600}"
)


def _page(title: str, body: str, status: int = 200) -> web.Response:
    document = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_STYLE}</style></head>'
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>"
    )
    return web.Response(status=status, text=document, content_type="text/html", headers=_HEADERS)


def _problem_page(problem: Problem) -> web.Response:
    return _page("This invitation cannot be used", f"<p>{html.escape(problem.detail or '')}</p>", problem.status)


_DESCRIPTION = (
    "No API key. The page the invitation mail links to: `GET` shows the tenant and the role and a form; "
    "the form `POST`s `token`, `first_name` and `last_name` (`application/x-www-form-urlencoded`) here and "
    "accepts the invitation as `POST /invitations/accept` does. Unusable links answer an HTML page with the "
    "status of the JSON endpoints (404 unknown, 410 used, superseded, withdrawn or expired, 409 already a member)."
)
_HTML_ANSWER = {"responses": {"200": {"description": "An HTML page.", "content": {"text/html": {}}}}}


@api.route(
    "GET",
    invitations.ACCEPT_PAGE_PATH,
    auth=False,
    tag=TAG,
    summary="The invitation page (HTML)",
    description=_DESCRIPTION,
    errors=(404, 409, 410),
    response_content_type="text/html",
    openapi_extra={
        **_HTML_ANSWER,
        "parameters": [{"name": "token", "in": "query", "required": True, "schema": {"type": "string"}}],
    },
)
async def show(call: Call) -> web.Response:
    """The page: tenant, role, expiry and the accept form (or why the link cannot be used)."""
    token = call.request.query.get("token", "")
    try:
        preview = await run_db(call.request.app, invitations.preview_invitation, token=token)
    except Problem as problem:
        return _problem_page(problem)
    tenant = html.escape(preview["tenant"]["name"])
    body = (
        f"<p>You are invited to join the tenant <strong id=\"tenant\">{tenant}</strong> as "
        f"<span class=\"role\" id=\"role\">{html.escape(preview['role'])}</span>, "
        f"with the address {html.escape(preview['email'])}.</p>"
        f"<p>The invitation expires at {preview['expires_at'].strftime('%Y-%m-%d %H:%M UTC')}.</p>"
        f'<form method="post" action="{invitations.ACCEPT_PAGE_PATH}">'
        f'<input type="hidden" name="token" value="{html.escape(token)}">'
        f'<label for="first_name">First name</label>'
        f'<input id="first_name" name="first_name" maxlength="{_NAME_MAX}" autocomplete="given-name">'
        f'<label for="last_name">Last name</label>'
        f'<input id="last_name" name="last_name" maxlength="{_NAME_MAX}" autocomplete="family-name">'
        f'<button type="submit" id="accept">Accept the invitation</button></form>'
    )
    return _page(f"Join {preview['tenant']['name']} on Tessera", body)


@api.route(
    "POST",
    invitations.ACCEPT_PAGE_PATH,
    auth=False,
    tag=TAG,
    summary="Accept an invitation from its page (HTML form)",
    description=_DESCRIPTION,
    errors=(404, 409, 410, 415),
    request_content_type="application/x-www-form-urlencoded",
    response_content_type="text/html",
    openapi_extra=_HTML_ANSWER,
)
async def accept(call: Call) -> web.Response:
    """Accept the invitation with the form's token and names; a page with the outcome."""
    if call.request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return _problem_page(Problem(415, "Send the form as application/x-www-form-urlencoded."))
    form = await call.request.post()
    names = {}
    for field in ("first_name", "last_name"):
        value = str(form.get(field) or "").strip()
        if len(value) > _NAME_MAX:
            return _problem_page(Problem(400, f"The {field.replace('_', ' ')} is longer than {_NAME_MAX} characters."))
        names[field] = value or None
    token = str(form.get("token") or "")
    try:
        member = await run_db(call.request.app, invitations.accept_invitation, token=token, **names)
    except Problem as problem:
        return _problem_page(problem)
    body = (
        f"<p id=\"accepted\">{html.escape(member['user']['email'])} is now a member with the role "
        f"<span class=\"role\">{html.escape(member['role'])}</span>.</p>"
    )
    return _page("Invitation accepted", body)
