"""The client keys package's exceptions."""

from __future__ import annotations

from infra.errors import Problem


class EncryptedPayloadError(Problem):
    """A client-encrypted payload that cannot be opened: a 400 problem naming the offending part."""

    def __init__(self, detail: str, *, field: str = "encrypted", code: str = "invalid_encrypted_payload"):
        super().__init__(
            400,
            detail,
            title="The encrypted payload cannot be decrypted",
            errors={field: [detail]},
            extra={"code": code},
        )
