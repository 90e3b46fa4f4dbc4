"""Tables: wallet tokens (spec 001 sections 2 and 4, wallet-a and wallet-b).

* ``wallet_merchant_keys``: a tenant's merchant keys. For wallet-a the payment processing
  certificate (PEM, public) and its private key; for wallet-b the merchant's P-256 private key. The
  private key is sealed under the tenant's data key (``private_key_ct``, :mod:`storage.crypto`,
  purpose ``wallet-merchant-key``) and never returned. Several may be active at once (rotation): a
  wallet-a token names the one it was sealed for by ``public_key_hash``.
* ``wallet_tokens``: a verified, decrypted wallet token. The network token (DPAN/MPAN) and its
  expiry are sealed (``data_ct``, purpose ``wallet-token``); the one-time cryptogram is sealed apart
  (``cryptogram_ct``, purpose ``wallet-cryptogram``) and erased at its first use or at
  ``cryptogram_expires_at``, whichever comes first. ``transaction_id`` is unique per tenant and
  wallet: a token is accepted once (replay guard).
* ``wallet_domains``: the domains a tenant registered, per environment (``sandbox`` or
  ``production``), at most 99 per tenant and environment; ``pending`` while a worker fetches the
  domain's association file and registers it with the wallet provider, then ``verified``.
* ``wallet_sessions``: a merchant session request while a worker asks the wallet provider's gateway;
  the answer is sealed (``session_ct``, purpose ``wallet-session``) and the row deleted once the
  request that made it has read it (or stopped waiting).
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, LargeBinary, String, UniqueConstraint
from sqlmodel import Field, SQLModel

from storage.states import WalletDomainStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class WalletMerchantKey(SQLModel, table=True):
    """A merchant key of a tenant for one ``wallet`` (``wallet-a`` or ``wallet-b``).

    ``public_key_hash`` base64 SHA-256 of the public key's DER SubjectPublicKeyInfo (what a wallet-a
    token header names); ``merchant_id`` the merchant identifier the certificate names (wallet-a);
    ``certificate_pem`` the payment processing certificate (wallet-a); ``expires_at`` its end of
    validity.
    """

    __tablename__ = "wallet_merchant_keys"
    __table_args__ = (Index("ix_wallet_merchant_keys_list", "tenant_id", "wallet", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    wallet: str = Field(max_length=16)
    public_key_hash: str = Field(max_length=64)
    merchant_id: str | None = Field(default=None, sa_column=Column(String(255), nullable=True))
    certificate_pem: str | None = Field(default=None, sa_column=Column(String(16384), nullable=True))
    private_key_ct: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class WalletToken(SQLModel, table=True):
    """A wallet token resource (spec 001 section 2) of ``wallet`` ``wallet-a`` or ``wallet-b``.

    ``card`` the enrichment object (no secret); ``data_ct`` the sealed ``{number, expiration_month,
    expiration_year}``; ``cryptogram_ct`` the sealed cryptogram (None once used or expired);
    ``eci_indicator`` the ECI the network sent (not secret).
    """

    __tablename__ = "wallet_tokens"
    __table_args__ = (UniqueConstraint("tenant_id", "wallet", "transaction_id", name="uq_wallet_tokens_transaction"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    wallet: str = Field(max_length=16)
    type: str = Field(max_length=16)  # dpan, mpan (wallet-a); network_token (wallet-b)
    status: str = Field(default="active", max_length=16)
    ingest_source: str = Field(default="device_decrypted", max_length=32)
    transaction_id: str = Field(sa_column=Column(String(255), nullable=False))
    payment_data_type: str | None = Field(default=None, max_length=16)
    device_manufacturer_identifier: str | None = Field(default=None, max_length=64)
    fingerprint: str | None = Field(default=None, max_length=64)
    card: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    data_ct: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    cryptogram_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    cryptogram_expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    eci_indicator: str | None = Field(default=None, max_length=8)
    expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class WalletDomain(SQLModel, table=True):
    """A domain a tenant registered for wallet-a payments in ``environment`` (sandbox or production)."""

    __tablename__ = "wallet_domains"
    __table_args__ = (UniqueConstraint("tenant_id", "environment", "domain", name="uq_wallet_domains"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    environment: str = Field(max_length=16)
    domain: str = Field(sa_column=Column(String(253), nullable=False))
    status: WalletDomainStatus = Field(default=WalletDomainStatus.PENDING, sa_type=state_type())
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class WalletSession(SQLModel, table=True):
    """A merchant session being created at the wallet provider's gateway ``validation_url``."""

    __tablename__ = "wallet_sessions"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    validation_url: str = Field(sa_column=Column(String(2048), nullable=False))
    display_name: str = Field(sa_column=Column(String(255), nullable=False))
    domain: str = Field(sa_column=Column(String(253), nullable=False))
    merchant_registration_id: str | None = Field(default=None, sa_column=Column(String(255), nullable=True))
    session_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
