"""Argument checks of every public entry point (a leaf module: it imports nothing of titan_ext): a wrong type raises :class:`ArgumentTypeError` (a ``TypeError``
that is also a ``ValueError``, so code written against the ``ValueError`` of earlier releases still
catches it) and an impossible value ``ValueError``, each naming the argument, instead of a TypeError /
AttributeError / IndexError from deep inside a planner. One definition per kind of argument; the entry
points call them first.

Numbers given as text (the command line, config files, environment variables) are read by
:func:`parse_int` / :func:`parse_float`: ASCII only (Python's ``int()`` and ``float()`` accept ``'٣'`` and
``'１２'``), at most :data:`MAX_NUMBER_CHARS` characters."""

from __future__ import annotations

import math
import numbers
import os
import stat
from typing import Any, Mapping, Sequence


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` (Python's convention) that is also the
    ``ValueError`` the public API raised for it before, so both ``except`` clauses catch it."""


#: the longest number read from text (a 5,000-digit integer is a typo or an attack, not a count)
MAX_NUMBER_CHARS = 64


def _ascii_number_text(text: Any, name: str) -> str:
    if not isinstance(text, str):
        raise ArgumentTypeError(f"{name} must be text, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped or not stripped.isascii() or len(stripped) > MAX_NUMBER_CHARS:
        what = "ASCII digits only" if stripped and not stripped.isascii() else \
            f"at most {MAX_NUMBER_CHARS} characters" if stripped else "not empty"
        raise ValueError(f"{name}: not a number ({what}), got {text[:MAX_NUMBER_CHARS]!r}")
    return stripped


def parse_int(text: str, name: str) -> int:
    """An integer written in ASCII (``'12'``, ``'-3'``): ``'١٢'``, ``'１２'``, ``'12.0'``, ``'1e3'`` and
    numbers longer than MAX_NUMBER_CHARS raise ValueError naming ``name``. The one reader of integers
    from text: the CLI and the config/environment parsers share it."""
    stripped = _ascii_number_text(text, name)
    try:
        return int(stripped, 10)
    except ValueError:
        raise ValueError(f"{name}: not an integer, got {text!r}") from None


def parse_float(text: str, name: str) -> float:
    """A real number written in ASCII (``'1.5'``, ``'1e-3'``, ``'inf'``, ``'nan'``: range checks are the
    caller's); non-ASCII digits and over-long text raise ValueError naming ``name``."""
    stripped = _ascii_number_text(text, name)
    try:
        return float(stripped)
    except ValueError:
        raise ValueError(f"{name}: not a number, got {text!r}") from None


def names_a_directory(text: str) -> bool:
    """Whether the text of a path names a directory whatever exists there (``out/``, ``.``, ``x/..``):
    checked on the text, since ``pathlib.Path`` drops a trailing ``/`` (``mine.csv/`` is ``mine.csv``)."""
    seps = (os.sep,) + ((os.altsep,) if os.altsep else ())
    last = text
    for sep in seps:
        last = last.rsplit(sep, 1)[-1]
    return not text or text.endswith(seps) or last in (".", "..")


def output_path_arg(value: Any, name: str = "path") -> str:
    """The path of an output file: text or ``os.PathLike``, no NUL, not naming a directory by its text."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{name} {value!r}: a path cannot contain a NUL character")
    if names_a_directory(value):
        raise ValueError(f"{name} {value!r} is a directory path; an output is a file")
    return value


def instance_arg(value: Any, name: str, cls: type | tuple[type, ...], what: str | None = None, *,
                 optional: bool = False) -> Any:
    """An instance of ``cls`` (``what`` describes it in the message; default: its class name); None passes
    when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, cls):
        if what is None:
            what = " or ".join(f"a {c.__name__}" for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise ArgumentTypeError(f"{name} must be {what}{' or None' if optional else ''}, got {type(value).__name__}")
    return value


def callable_arg(value: Any, name: str, what: str = "callable", *, optional: bool = False) -> Any:
    """A callable (``what`` describes it: ``"a callable (metrics -> bool)"``); None passes when ``optional``."""
    if value is None and optional:
        return None
    if not callable(value):
        raise ArgumentTypeError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
    return value


def mapping_arg(value: Any, name: str, what: str = "") -> Mapping:
    """A mapping (``what`` names its keys and values: ``"group -> seconds"``)."""
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name} must be a mapping{' ' + what if what else ''}, got {type(value).__name__}")
    return value


def sequence_arg(value: Any, name: str, what: str = "a sequence") -> Sequence:
    """A sequence that is not text (``"ab"`` is not a list of two names); ``what`` describes it."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def real_arg(value: Any, name: str, *, minimum: float | None = None, maximum: float | None = None,
             positive: bool = False, optional: bool = False, allow_inf: bool = False) -> float | None:
    """A finite real number (int or float, not a bool, not NaN; +inf only with ``allow_inf``) within
    [minimum, maximum] (> 0 when ``positive``); None passes when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) and not (allow_inf and value == math.inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return value


def bool_arg(value: Any, name: str) -> bool:
    """A real bool: ``"yes"``, ``"false"``, 1 or None are refused (``bool("false")`` is True)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return value


def choice_arg(value: Any, name: str, choices: Sequence[Any]) -> Any:
    if isinstance(value, (list, dict, set)) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def int_arg(value: Any, name: str, minimum: int | None = None, *, optional: bool = False) -> int | None:
    """An integer (not a bool, not a float) >= ``minimum``; None passes when ``optional``."""
    if value is None and optional:
        return None
    if type(value) is int:  # the usual case, without the ABC check below (a hot path: warm-up counts per check)
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def plan_arg(value: Any, name: str = "plan") -> Mapping:
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name} must be a mapping rank → list of actions, got {type(value).__name__}")
    for rank, actions in value.items():
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
            raise ArgumentTypeError(f"{name}[{rank!r}] must be a list of actions, got {type(actions).__name__}")
    return value


def counts_arg(value: Any, name: str, length: int | None = None, *, minimum: int | None = None) -> list[int]:
    """A sequence of integers (e.g. warm-up counts), of ``length`` when given, each >= ``minimum``."""
    sequence_arg(value, name, "a sequence of integers")
    out = [int_arg(v, f"{name}[{i}]", minimum) for i, v in enumerate(value)]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    return out


def reals_arg(value: Any, name: str, length: int | None = None, **limits: Any) -> list[float]:
    """A sequence of real numbers, of ``length`` when given, each checked by :func:`real_arg` with
    ``limits`` (``minimum``, ``positive``, ``allow_inf`` ...), naming ``name[i]``."""
    sequence_arg(value, name, "a sequence of numbers")
    out = [real_arg(v, f"{name}[{i}]", **limits) for i, v in enumerate(value)]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    return out


def regular_file_stat(path: str, max_bytes: int, label: str, kind: str, error: type = ValueError) -> os.stat_result:
    """``os.stat`` of an input file that must be a regular file of at most ``max_bytes`` (a FIFO or
    ``/dev/zero`` would block or read without bound): ``error`` naming ``label`` and the ``kind`` of file
    expected otherwise. The one check of the inputs the trainer reads (config files, delay traces)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise error(f"{label}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise error(f"{label}: {what}; it must be a {kind} file")
    if st.st_size > max_bytes:
        raise error(f"{label}: {st.st_size} bytes, more than the limit of {max_bytes >> 20} MiB for a {kind} file")
    return st


def read_input_text(path: str, max_bytes: int, label: str, kind: str, error: type = ValueError) -> str:
    """The UTF-8 text of an input file read with a bound of ``max_bytes`` (checked with
    :func:`regular_file_stat` first): ``error`` naming ``label`` when it cannot be read, is larger, or is
    not UTF-8 text."""
    regular_file_stat(path, max_bytes, label, kind, error)
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{label}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise error(f"{label}: more than the limit of {max_bytes >> 20} MiB for a {kind} file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{label}: not UTF-8 text (a {kind} file)") from None
