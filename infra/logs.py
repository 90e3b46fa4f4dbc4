"""Structured logs (structlog): one JSON object per line, or a readable line for people (``tessera dev``).

Every line carries ``trace_id``, ``tenant_id``, ``job_id`` and ``task`` (null when not known), taken
from context variables: the api middleware binds the request's (``app/main.py``), the Celery signals
bind the task's around each run (``workers/signals.py``). Code logs with the standard library
(``logging.getLogger(name)``, ``extra={...}`` for fields) or with :func:`get_logger`; both end up in
the same handler, so a line looks the same whichever was used.

One line per unit of work: at INFO, :class:`QuietCelery` leaves out Celery's "received" line (the
outcome line follows), beat's "sending due task" lines, and the outcome line of a periodic task that
found nothing to do (:func:`quiet_periodic`); failures and retries always show. ``TESSERA_LOG_LEVEL=
DEBUG`` shows everything. The console format leaves out Celery's ``data`` field (the message says it).

Never log a card number, a CVC, an API key, a signing secret or token data: log ids. The test suite
scans every record for them (``tests/ops/test_logs.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from config.settings import Settings

#: The context fields every line carries.
CONTEXT_FIELDS = ("trace_id", "tenant_id", "job_id", "task")

# A callable giving fields known only later in a unit of work (the tenant, once the api key is checked).
_LAZY: contextvars.ContextVar[Callable[[], dict[str, Any]] | None] = contextvars.ContextVar(
    "tessera_log_lazy", default=None
)


def bind_lazy(fields: Callable[[], dict[str, Any]]) -> contextvars.Token:
    """Add ``fields()`` to every line logged in the current context (read when each line is made)."""
    return _LAZY.set(fields)


def unbind_lazy(token: contextvars.Token) -> None:
    """Undo the :func:`bind_lazy` that returned ``token``."""
    with contextlib.suppress(ValueError):
        _LAZY.reset(token)


def current_context() -> dict[str, Any]:
    """The context fields bound now (bound values and lazy ones), without the unset ones."""
    found = dict(structlog.contextvars.get_contextvars())
    lazy = _LAZY.get()
    if lazy is not None:
        with contextlib.suppress(Exception):
            found.update({k: v for k, v in lazy().items() if v is not None and k not in found})
    return {k: v for k, v in found.items() if v is not None}


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Bind ``fields`` to every line logged inside the block (in this thread or task)."""
    with structlog.contextvars.bound_contextvars(**{k: v for k, v in fields.items() if v is not None}):
        yield


def bind(**fields: Any) -> None:
    """Bind ``fields`` to every later line of the current context (see :func:`clear`)."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in fields.items() if v is not None})


def clear() -> None:
    """Forget every field bound in the current context."""
    structlog.contextvars.clear_contextvars()
    _LAZY.set(None)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing through the standard library (``log.info("event", key=value)``)."""
    return structlog.get_logger(name)


# ---- processors ----------------------------------------------------------------------------------


def _add_lazy(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    lazy = _LAZY.get()
    if lazy is not None:
        try:
            extra = lazy()
        except Exception:  # noqa: BLE001 - a log line never fails for its context
            extra = {}
        for key, value in extra.items():
            if value is not None and event.get(key) is None:
                event[key] = value
    return event


def _context_defaults(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    for key in CONTEXT_FIELDS:
        value = event.get(key)
        event[key] = None if value is None else str(value)
    return event


def _drop_empty(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    return {k: v for k, v in event.items() if v is not None and not (k == "data" and _is_celery(event))}


def _is_celery(event: Mapping[str, Any]) -> bool:
    return str(event.get("logger", "")).startswith("celery")


#: Task names run on a schedule whose "nothing to do" outcome lines are left out (:func:`quiet_periodic`).
_PERIODIC: set[str] = set()
#: What a periodic task returns when it found nothing to do, as Celery's log line shows it.
_NOTHING_DONE = frozenset({"0", "None", "{}", "[]", "()", "False", "''"})


def quiet_periodic(task_names) -> None:
    """Leave out the INFO outcome line of these scheduled tasks when they found nothing to do
    (returned 0, None or an empty collection): beat runs some every few seconds."""
    _PERIODIC.update(task_names)


class QuietCelery(logging.Filter):
    """Drops Celery's per-message chatter at INFO so the console shows one line per unit of work
    (see the module docstring). Passes everything when the root logger is at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        if record.name == "celery.worker.strategy":
            return False
        if record.name == "celery.beat":
            return "Sending due task" not in str(record.msg)
        if record.name == "celery.app.trace":
            data = getattr(record, "data", None)
            if isinstance(data, dict) and data.get("name") in _PERIODIC:
                return str(data.get("return_value")) not in _NOTHING_DONE
        return True


_FIRST = ("time", "level", "logger", "message", *CONTEXT_FIELDS)


def _ordered(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    ordered = {key: event.pop(key) for key in _FIRST if key in event}
    ordered.update(event)
    return ordered


_SHARED: list[Processor] = [
    structlog.contextvars.merge_contextvars,
    _add_lazy,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
]


def _configure_structlog() -> None:
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.render_to_log_kwargs,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def _traceback_without_locals():
    """The console's traceback format: rich when available, never with the frames' local variables
    (they hold request bodies, card numbers, keys)."""
    if structlog.dev.rich is not None:
        return structlog.dev.RichTracebackFormatter(show_locals=False)
    return structlog.dev.plain_traceback


def formatter(log_format: str, *, colors: bool = False) -> logging.Formatter:
    """The formatter of ``TESSERA_LOG_FORMAT``: ``json`` (one object a line) or ``console``."""
    chain: list[Processor]
    if log_format == "json":
        chain = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _context_defaults,
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("message"),
            _ordered,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        chain = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _context_defaults,
            _drop_empty,
            structlog.dev.ConsoleRenderer(
                colors=colors, sort_keys=False, timestamp_key="time", exception_formatter=_traceback_without_locals()
            ),
        ]
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder()], processors=chain, pass_foreign_args=False
    )


_STATE = {"configured": False}


def is_configured() -> bool:
    """True once :func:`configure_logging` ran in this process (the ``tessera`` commands)."""
    return _STATE["configured"]


def configure_logging(settings: Settings) -> None:
    """Send every log record of this process to stderr in the format of ``settings``."""
    _STATE["configured"] = True
    _configure_structlog()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(settings.log_format, colors=sys.stderr.isatty()))
    handler.addFilter(QuietCelery())
    # boto3 says "Found credentials in environment variables." once per process and client: not news.
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    logging.captureWarnings(True)  # Python warnings become log lines too, in the same format


_configure_structlog()
