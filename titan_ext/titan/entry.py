"""The config checks before TorchTitan's ``main``, under either entry point: one line, exit 2, before any
process group exists.

``python -m titan_ext.train`` calls them itself. Under TorchTitan's own entry point (``python -m
torchtitan.train``, the module run as ``__main__``) nothing of titan_ext runs before TorchTitan starts
parsing; the first code of ours is ``import titan_ext``, which TorchTitan's parser causes by importing our
config module -- 0.2: ``job.custom_config_module = "titan_ext.titan.config"`` (after TorchTitan has read
the TOML file, before it builds the config and before its command-line parser, tyro), 0.3: ``--module
titan_ext.titan`` (its ``config_registry``, before tyro) -- or, with 0.2's ``custom_import`` alone, the
trainer (before its process group). With torchtitan loaded, ``titan_ext/__init__.py`` registers and calls
:func:`check_stock_entry`, which parses the same command line once, quietly, and runs the checks
``titan_ext.train`` runs (numbers in ASCII digits, the TOML file's shape,
:func:`titan_ext.titan.jobcheck.check_job_config`: the ``[titan_ext]`` values, paths, the schedule,
environment variables), so a bad value ends with the same one line and exit 2, not with tyro's boxed
message or a traceback.

What runs before that import stays TorchTitan's (0.2: reading the TOML file -- a syntax error is its
traceback, a FIFO blocks there; ``python -m titan_ext.train`` checks the file first). See docs/titan.md
"Errors under TorchTitan's own entry point".
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

from titan_ext.titan.jobcheck import (
    JobConfigError,
    check_ascii_numbers,
    check_config_file,
    check_job_config,
    config_file_arg,
    world_size,
)

__all__ = ["boxed_message", "check_stock_entry", "config_error_exit", "parse_quietly", "stock_entry_point"]


def config_error_exit(e: Exception) -> None:
    """One line from rank 0 (the others exit quietly: no process group exists yet), exit 2 everywhere."""
    import tomllib

    what = "malformed TOML" if isinstance(e, tomllib.TOMLDecodeError) else "configuration error"
    if os.environ.get("RANK", "0") == "0":
        lines = str(e).splitlines() or [type(e).__name__]
        print(f"titan_ext: {what}: {lines[0]}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def parse_quietly(manager, argv: list[str]):
    """TorchTitan's parse (``manager.parse_args(argv)``), with the ``[titan_ext]`` checks left to
    :func:`check_job_config` and TorchTitan's warnings held back (its own parse follows): a parser error
    (tyro's boxed message) becomes a :class:`JobConfigError` of one line; ``--help`` is shown as
    TorchTitan's parser wrote it."""
    from titan_ext import _flags

    titan_logger = logging.getLogger()
    level, deferred = titan_logger.level, _flags.DEFER_SECTION_CHECK
    _flags.DEFER_SECTION_CHECK = True
    titan_logger.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return manager.parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stderr.write(said.getvalue())
            raise
        raise JobConfigError(f"command line: {boxed_message(said.getvalue())}") from None
    finally:
        _flags.DEFER_SECTION_CHECK = deferred
        titan_logger.setLevel(level)


def boxed_message(text: str) -> str:
    """The error TorchTitan's CLI parser (tyro, through rich) prints, as one line: the first paragraph
    that says something (``what: why``) -- rich draws a title, a box and separators with Unicode
    characters on a terminal, without the box when it writes elsewhere."""
    paragraphs, current = [], []
    for line in text.splitlines():
        raw = line.strip()
        if raw[:1] in ("╭", "╰", "+"):  # a border (with the title in it)
            raw = ""
        body = raw.strip("│|").strip()
        if not body or set(body) <= set("─-"):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(body)
    if current:
        paragraphs.append(" ".join(current))
    return next((p for p in paragraphs if ":" in p),
                next((p for p in paragraphs if "--" in p), paragraphs[0] if paragraphs else "invalid arguments"))


def stock_entry_point() -> bool:
    """This process runs TorchTitan's own ``torchtitan.train`` as its main module (``python -m
    torchtitan.train``, torchrun's ``-m torchtitan.train``, or the file itself)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name == "torchtitan.train"
    path = getattr(main, "__file__", None)
    return bool(path) and Path(path).name == "train.py" and Path(path).parent.name == "torchtitan"


_stock_checked = False


def check_stock_entry(argv: list[str] | None = None) -> None:
    """Under TorchTitan's own entry point (:func:`stock_entry_point`), once per process: the command line
    (``sys.argv[1:]``) is checked the way ``titan_ext.train`` checks it -- numbers in ASCII digits, the TOML
    file's shape (0.2), TorchTitan's parse of it and :func:`check_job_config` -- and an error is one line
    from rank 0 and exit 2 on every rank (:func:`config_error_exit`). Elsewhere nothing happens (a library
    caller of ``ConfigManager`` gets exceptions, as before)."""
    global _stock_checked
    if _stock_checked or not stock_entry_point():
        return
    _stock_checked = True  # once, whichever import comes first (the parse below imports our config module)
    from torchtitan.config import ConfigManager

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        check_ascii_numbers(args)
        path = config_file_arg(args)
        if path is not None:
            check_config_file(path)
        check_job_config(parse_quietly(ConfigManager(), args), world_size=world_size())
    except ValueError as e:  # TitanExtConfigError, JobConfigError, TorchTitan's unknown keys
        config_error_exit(e)
    except ImportError as e:  # not an ImportError: 0.3's loader would take it for a missing config_registry
        raise RuntimeError(f"titan_ext's config check under torchtitan.train failed to import: {e}") from e
