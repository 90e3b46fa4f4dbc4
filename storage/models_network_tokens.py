"""Tables: Network tokens, token intents (spec, core document: Network token; Token intents).

Sensitive values are stored only as AES-256-GCM ciphertext made by :mod:`storage.crypto` (columns
ending in ``_ct``): the network token's own number (DPAN), the card data a provisioning job still
needs, and a token intent's card data. What is stored in clear is what the API shows anyway to a
caller without reveal rights (brand, BIN, last four digits, expirations, the PAR) plus ids and states.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, LargeBinary, String
from sqlmodel import Field, SQLModel

from storage.states import NetworkTokenStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class NetworkToken(SQLModel, table=True):
    """A network token of a tenant (spec "Network token"), provisioned by a card network.

    ``status``: ``inactive`` (recorded, provisioning job under way), ``active``, ``suspended``. A
    removed network token (``DELETE``, or provisioning that failed for good) has no row.

    * ``data_ct``: sealed ``{number, expiration_month, expiration_year}`` of the network token (the
      DPAN); None while inactive. ``details``: the ``network_token`` details object (bin, last4,
      brand ...), None while inactive.
    * ``card``: the card it was made from as shown (``brand, bin, last4, expiration_month,
      expiration_year``; the expiration overrides when sent).
    * ``source_ct``: sealed provisioning input (card number, expiration, cvc, cardholder info) kept
      only until the provisioning job ends, then set to None.
    * ``network_reference``: the card network's id of the token; ``par`` its payment account reference.
    * ``pending_job_id``: the job of the provisioning, suspend or resume under way (one at a time).
    * ``announced``: True once ``POST /network-tokens`` answered 202 with this id, so a later
      provisioning failure is told with the ``network-token.failed`` event.
    * ``card_art`` / ``card_art_at``: card art last fetched from the network, and when.
    """

    __tablename__ = "network_tokens"
    __table_args__ = (
        Index("ix_network_tokens_intent", "tenant_id", "token_intent_id"),
        Index("ix_network_tokens_par", "tenant_id", "par"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    status: NetworkTokenStatus = Field(default=NetworkTokenStatus.INACTIVE, sa_type=state_type())
    data_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    details: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    card: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    source_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    par: str | None = Field(default=None, max_length=64)
    network_reference: str | None = Field(default=None, max_length=200)
    token_id: str | None = Field(default=None, sa_column=Column(String(400), nullable=True))
    token_intent_id: uuid.UUID | None = None
    merchant_id: str | None = Field(default=None, max_length=64)
    pending_job_id: uuid.UUID | None = None
    announced: bool = False
    card_art: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    card_art_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class TokenIntent(SQLModel, table=True):
    """A token intent: card data held for 24 hours until it becomes a token (or expires).

    ``data_ct`` is the sealed card data ``{number, expiration_month?, expiration_year?, cvc?, name?}``;
    ``cvc_expires_at`` is when its ``cvc`` is dropped (the tokens' retention rule); ``token_id`` the
    card token it became (``POST /token-intents/{id}/convert``), at ``converted_at``.
    """

    __tablename__ = "token_intents"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    type: str = Field(max_length=16)  # card
    data_ct: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    fingerprint: str | None = Field(default=None, max_length=64)
    token_id: str | None = Field(default=None, sa_column=Column(String(400), nullable=True))
    converted_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    expires_at: dt.datetime = Field(sa_column=_ts(index=True))
    cvc_expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True, index=True))
