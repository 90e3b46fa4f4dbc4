"""The pages a person sees at the invitation mail's link, ``/invitations/accept?token=``.

The link's endpoints answer a browser (``Accept: text/html``) with pages and an API client with JSON
(``app/routes/tenancy.py``): ``GET`` shows which tenant the link invites to and with which role,
and a form (the invitee's first and last name, a button) that ``POST``s the token to the same path as
an HTML form; that post accepts the invitation as the JSON post does
(``domain.tenancy.invitations.accept_invitation``) and answers a page saying so. An unknown, used,
superseded, withdrawn or expired link answers a page with the same status and reason as the JSON
answers (404, 410, 409).

The pages load nothing (no script, no external style): ``Content-Security-Policy`` allows inline
style and form posts to this origin only, framing is refused (a hidden frame cannot click the
button) and no referrer is sent (the address holds the token).
"""

from __future__ import annotations

import html

from aiohttp import web

from domain.tenancy import invitations
from infra.errors import Problem

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: The longest first or last name the form takes (the accept body's limit).
NAME_MAX = 100
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


def wants_html(request: web.Request) -> bool:
    """True when the client is a browser asking for a page (``Accept`` names ``text/html`` and does not
    put JSON first); an API client (``application/json``, ``*/*`` or no ``Accept``) gets JSON."""
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and not accept.lstrip().startswith(("application/json", "application/problem+json"))


def problem_page(problem: Problem) -> web.Response:
    """Why the link cannot be used, with the status the JSON answer would have (404, 409, 410)."""
    return _page("This invitation cannot be used", f"<p>{html.escape(problem.detail or '')}</p>", problem.status)


def invitation_page(preview: dict, token: str) -> web.Response:
    """The page of ``GET /invitations/accept?token=`` for a browser: tenant, role, expiry and a form
    that posts the token and the invitee's names to ``POST /invitations/accept``."""
    tenant = html.escape(preview["tenant"]["name"])
    body = (
        f'<p>You are invited to join the tenant <strong id="tenant">{tenant}</strong> as '
        f'<span class="role" id="role">{html.escape(preview["role"])}</span>, '
        f"with the address {html.escape(preview['email'])}.</p>"
        f"<p>The invitation expires at {preview['expires_at'].strftime('%Y-%m-%d %H:%M UTC')}.</p>"
        f'<form method="post" action="{invitations.ACCEPT_PATH}">'
        f'<input type="hidden" name="token" value="{html.escape(token)}">'
        f'<label for="first_name">First name</label>'
        f'<input id="first_name" name="first_name" maxlength="{NAME_MAX}" autocomplete="given-name">'
        f'<label for="last_name">Last name</label>'
        f'<input id="last_name" name="last_name" maxlength="{NAME_MAX}" autocomplete="family-name">'
        f'<button type="submit" id="accept">Accept the invitation</button></form>'
    )
    return _page(f"Join {preview['tenant']['name']} on Tessera", body)


def accepted_page(member: dict) -> web.Response:
    """The page answering the form's post: who is now a member, with which role (201)."""
    body = (
        f'<p id="accepted">{html.escape(member["user"]["email"])} is now a member with the role '
        f'<span class="role">{html.escape(member["role"])}</span>.</p>'
    )
    return _page("Invitation accepted", body, 201)
