"""Agentic payment methods, rails, providers, idempotency, leases and agents (spec 001 sections 2-8).

Modules:

* :mod:`core.agentic.payment_methods`: the API side (create, list, read, retry, errors, delete),
  views, and the pieces the workers share;
* :mod:`core.agentic.enrollment`: the worker side (rail enrollment, polling, the delete cascade);
* :mod:`core.agentic.idempotency`: ``<prefix>-IDEMPOTENCY-KEY`` records of creates;
* :mod:`core.agentic.leases`: operation leases (the source of the ``409 ..._IN_PROGRESS`` answers);
* :mod:`core.agentic.errors`: the error catalogue and the agentic problem form;
* :mod:`core.agentic.consumers`: country and language codes of the consumer;
* :mod:`core.agentic.agents`: the deprecated agents resource.

The provider adapters are :mod:`core.providers.agentic`; the tables :mod:`storage.models_agentic`.
"""
