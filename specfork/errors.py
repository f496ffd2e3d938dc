"""Errors a user can cause: the CLI prints them as one line and exits non-zero."""


class SpecforkError(Exception):
    """Bad input or a missing resource; never a bug in specfork."""
