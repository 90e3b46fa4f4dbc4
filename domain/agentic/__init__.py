"""Agentic payment methods, rails, allowances, credentials, idempotency, leases and agents (spec 001
sections 2-8).

Modules:

* :mod:`domain.agentic.service`: the payment method verbs of the API (create, list, read, retry,
  errors, delete);
* :mod:`domain.agentic.allowances`: the allowance verbs (create, list, read, errors, update, verify,
  cancel); :mod:`domain.agentic.credentials`: the payment credential verbs (mint, read);
* :mod:`domain.agentic.views`: the public dict shapes (one function per shape);
* :mod:`domain.agentic.errors`: the error catalogue and the agentic problem form;
* :mod:`domain.agentic.payment_methods` and :mod:`domain.agentic.allowance_state`: the records and
  rules the verbs, the workers and the sweeps share; :mod:`domain.agentic.money`: exact amounts;
* :mod:`domain.agentic.enrollment` and :mod:`domain.agentic.allowance_work`: the worker side (rail
  enrollment, polling, the delete cascade; allowance setup, update, verification, cancellation,
  minting);
* :mod:`domain.agentic.units`: keyed operations' own transactions;
* :mod:`domain.agentic.idempotency`: ``<prefix>-IDEMPOTENCY-KEY`` records of creates and mints;
* :mod:`domain.agentic.leases`: operation leases (the source of the ``409 ..._IN_PROGRESS`` answers);
* :mod:`domain.agentic.consumers`: country and language codes of the consumer;
* :mod:`domain.agentic.agents`: the deprecated agents resource.

The provider adapters are :mod:`providers.agentic` (interface, value types, failures) and
:mod:`providers.agentic_http` (the HTTP adapter); the tables :mod:`storage.models_agentic` and
:mod:`storage.models_allowances`.
"""
