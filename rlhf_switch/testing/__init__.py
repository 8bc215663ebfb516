"""Helpers tests and examples import: tiny random models of every family (no downloads)."""
