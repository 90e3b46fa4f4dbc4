"""Fixtures of the agentic tests: the kill tests' isolated Redis key prefix
(:func:`tests.factories.kill_stack.isolated_prefix`)."""

from tests.factories.kill_stack import isolated_prefix  # noqa: F401
