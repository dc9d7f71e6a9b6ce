"""Argument checks of the public plan/ API: a wrong type or an impossible value raises
``ValueError`` naming the argument, instead of a TypeError / AttributeError / IndexError from deep
inside a planner. One definition per kind of argument; the entry points call them first."""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

from .profile import PipelineProfile


def profile_arg(value: Any, name: str = "profile") -> PipelineProfile:
    if not isinstance(value, PipelineProfile):
        raise ValueError(f"{name} must be a PipelineProfile, got {type(value).__name__}")
    return value


def int_arg(value: Any, name: str, minimum: int | None = None, *, optional: bool = False) -> int | None:
    """An integer (not a bool, not a float) >= ``minimum``; None passes when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def plan_arg(value: Any, name: str = "plan") -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping rank → list of actions, got {type(value).__name__}")
    for rank, actions in value.items():
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
            raise ValueError(f"{name}[{rank!r}] must be a list of actions, got {type(actions).__name__}")
    return value


def counts_arg(value: Any, name: str, length: int | None = None) -> list[int]:
    """A sequence of integers (e.g. warm-up counts), of ``length`` when given."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of integers, got {type(value).__name__}")
    out = [int_arg(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    return out


def link_arg(profile: PipelineProfile, link: Any, name: str = "link") -> int:
    link = int_arg(link, name, 0)
    if link >= profile.num_stages - 1:
        raise ValueError(f"{name} {link} does not exist (links are 0..{profile.num_stages - 2})")
    return link


def parse_ascii_number(text: Any, name: str = "value", *, integer: bool = False) -> float | int:
    """``text`` read as a number written in ASCII only (Python's ``int``/``float`` also take ``'٣'`` or
    ``'１２'``): ``ValueError`` naming ``name`` otherwise. No range check (the callers bound it)."""
    s = text.strip() if isinstance(text, str) else None
    if not s or not s.isascii() or len(s) > 64:
        raise ValueError(f"{name} {text!r} is not {'an integer' if integer else 'a number'} in ASCII digits")
    try:
        return int(s) if integer else float(s)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not {'an integer' if integer else 'a number'}") from None
