"""Tests of the account updater (``domain/account_updater``, its routes and tasks)."""
