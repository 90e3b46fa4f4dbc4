"""Wallet payment tokens (spec 001 sections 2, 4, 5 and 9): verification and decryption.

- :mod:`domain.wallets.wallet_a`: wallet-a (Apple Pay) EC_v1 tokens, CMS signature to a pinned root;
- :mod:`domain.wallets.wallet_b`: wallet-b (Google Pay) ECv2 tokens, signing key hierarchy;
- :mod:`domain.wallets.errors`: the typed refusals (a machine ``code`` and a 4xx problem);
- :mod:`domain.wallets.fields`: the field readers and card shapes both share.

Nothing here stores anything: a caller gets a fully verified payment or an error.
"""
