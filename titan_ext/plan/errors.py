"""The exception type of a wrong argument type in the public plan/ API (a leaf module: profile.py and
args.py both raise it)."""

from __future__ import annotations


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` (Python's convention) that is also the
    ``ValueError`` the public API raised for it before, so both ``except`` clauses catch it."""
