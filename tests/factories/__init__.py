"""Builders shared by the tests of several packages: plain functions that make requests, rows and
fixtures' inputs (one module per domain package; no tests here)."""
