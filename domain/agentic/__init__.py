"""Agentic payment methods, rails, providers, idempotency, leases and agents (spec 001 sections 2-8).

Modules:

* :mod:`domain.agentic.payment_methods`: the API side (create, list, read, retry, errors, delete),
  views, and the pieces the workers share;
* :mod:`domain.agentic.enrollment`: the worker side (rail enrollment, polling, the delete cascade);
* :mod:`domain.agentic.idempotency`: ``<prefix>-IDEMPOTENCY-KEY`` records of creates;
* :mod:`domain.agentic.leases`: operation leases (the source of the ``409 ..._IN_PROGRESS`` answers);
* :mod:`domain.agentic.errors`: the error catalogue and the agentic problem form;
* :mod:`domain.agentic.consumers`: country and language codes of the consumer;
* :mod:`domain.agentic.agents`: the deprecated agents resource.

The provider adapters are :mod:`providers.agentic`; the tables :mod:`storage.models_agentic`.
"""
