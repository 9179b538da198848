"""Errors the harness reports to the user (caught in ``cli.main`` and printed plainly)."""

from __future__ import annotations


class SetupError(RuntimeError):
    """A missing piece of the environment; the message names the command that installs it."""


class UsageError(ValueError):
    """A bad flag value; the message names the flag, what was expected and what was given."""
