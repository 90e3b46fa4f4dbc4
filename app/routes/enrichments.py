"""``POST /enrichments/bank-account-verify`` (:mod:`domain.enrichments.bank_accounts`): the provider is
called by a worker; the handler records the job, waits for it without blocking the event loop and
answers ``{status}``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.api import Api, Call
from app.schemas import RequestModel, ResponseModel
from domain.enrichments import bank_accounts

api = Api()
TAG = "Enrichments"


class BankAccountVerifyIn(RequestModel):
    """`POST /enrichments/bank-account-verify`."""

    token_id: str = Field(
        min_length=1, max_length=400, description="The id of a `bank` token (routing and account number) of the tenant."
    )


class BankAccountVerifyOut(ResponseModel):
    """What the provider said of the account."""

    status: Literal["enabled", "disabled", "error"] = Field(
        description="`enabled`: the account is open and takes debits; `disabled`: it is closed or blocked; "
        "`error`: the provider could not verify it."
    )


@api.route(
    "POST",
    "/enrichments/bank-account-verify",
    permission=bank_accounts.PERMISSION,
    body=BankAccountVerifyIn,
    response=BankAccountVerifyOut,
    tag=TAG,
    summary="Verify a bank token's account",
    errors=(400, 401, 403, 404, 422, 502, 504),
    description="A decision of this implementation, as the hosted service offers it: asks a bank account verification "
    "provider whether the account of a `bank` token takes debits and answers `{status}` (`enabled`, `disabled` or "
    "`error`). Permission `token:bank:use:proxy` (the hosted service's `token:use`, for the bank classification). "
    "The provider is called by a worker (the job id is its idempotency key, up to 3 attempts); this request waits "
    "for the outcome up to `TESSERA_NETWORK_TOKEN_WAIT_SECONDS` (default 10 s). Test tenants reach the sandbox: "
    "routing number `021000021` with account `00001` is `enabled`, `00002` `disabled`, any other account "
    "`error`. Errors: 400 when `token_id` is missing or names a token that is not of type `bank`; 404 when the "
    "token does not exist; 422 when no provider is configured (production tenants on this deployment); 502 when "
    "the provider refused or failed; 504 when it did not answer within the wait. Each verification writes a "
    "`use` log row on the token.",
)
async def verify(call: Call):
    """Record the verification, wait, answer ``{status}`` (see the description)."""
    started = await call.db(bank_accounts.verify_start, call.caller, call.body.token_id)
    await call.wait_for_jobs([started.job_id], timeout=call.settings.network_token_wait_seconds)
    return await call.db(bank_accounts.verify_outcome, started)
