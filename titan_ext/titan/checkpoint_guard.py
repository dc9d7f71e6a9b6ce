"""A manifest beside every checkpoint the trainer saves, checked before TorchTitan loads one.

TorchTitan resumes from ``<dump_folder>/<checkpoint.folder>/step-N`` (or ``checkpoint.initial_load_path``)
with torch.distributed.checkpoint (DCP), which unpickles ``.metadata`` on every rank
(``FileSystemReader.read_metadata``) and the non-tensor entries of the data files with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``): a crafted file there runs code in
the job. :func:`guard_checkpointer` wraps the two methods of the trainer's checkpoint manager every save
and load goes through, ``dcp_save`` and ``dcp_load`` (the same in TorchTitan 0.2's
``torchtitan.components.checkpoint.CheckpointManager`` and 0.3's
``torchtitan.components.checkpointer.CheckpointManager``; their signatures are checked at registration,
``adapters.*.SIGNATURES``):

* **save**: once DCP has written a local step folder, rank 0 (DCP's coordinator: it writes ``.metadata``
  after every rank's files are written) writes :data:`MANIFEST` into it (:func:`write_manifest`):
  titan_ext's version, the step, the size and SHA-256 of every other file of the folder. A synchronous
  save writes it before ``dcp_save`` returns; an asynchronous one (``[checkpoint] async_mode``) when
  DCP's save future completes, and the future TorchTitan keeps (``save_future``, which it waits on
  before the next save and S4 waits on before it exits) completes only after the manifest is written.
* **load**: before DCP reads a step folder (HuggingFace safetensors loads excepted: DCP reads those
  without pickle), :func:`check_step_folder` refuses it with :class:`UntrustedCheckpoint` -- one line
  naming the file and what to do -- when it has no manifest, or a file is missing, not listed, of
  another size, or of another SHA-256. ``[titan_ext] trust_checkpoint = true`` loads without the check.

Cost: rank 0 reads the whole step folder once more at each save and at each load for SHA-256 (about
1-2 GB/s on one core, or the disk's speed if lower); a synchronous save does it in the training step
(the other ranks wait at their next collective), an asynchronous one in DCP's completion thread. The
other ranks hash only the ``*.metadata`` files (DCP's small pickled index, which each rank unpickles
before DCP's first collective) and compare the other files' sizes: they read a data file only after
DCP's planning collective, which rank 0 joins only once its full check passed (when it fails, they wait
in that collective until the launcher stops the job).

Not covered: the manifest lies beside the checkpoint, so it refuses step folders this trainer did not
write (copied or dropped in, altered afterwards), not a writer who rewrites the manifest too. Remote
(``scheme://``) checkpoint folders (TorchTitan 0.3) get no manifest and are refused unless trusted.
HuggingFace saves (``checkpoint.last_save_in_hf``) get none (they hold no pickle). An asynchronous
save whose process exits before the save completed gets none, so it is refused at resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_ext import __version__
from titan_ext.titan.jobcheck import JobConfigError

__all__ = ["MANIFEST", "UntrustedCheckpoint", "write_manifest", "check_step_folder", "guard_checkpointer"]

MANIFEST = "titan_ext_manifest.json"
_FIX = ("delete that step folder, or set [titan_ext] trust_checkpoint = true (--titan_ext.trust_checkpoint) "
        "if you trust where it came from")


class UntrustedCheckpoint(JobConfigError):
    """A checkpoint step folder refused before anything of it is unpickled (raised on the rank that found
    it, when TorchTitan loads); the message names the file and what to do."""


def _files(folder: Path) -> dict[str, Path]:
    """Every file under ``folder`` but the manifest, by path relative to it."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder, step: int | None) -> Path:
    """Write ``folder/titan_ext_manifest.json`` (atomically): titan_ext's version, ``step`` and the size
    and SHA-256 of every other file under ``folder``. Reads every file once."""
    folder = Path(folder)
    files = {name: {"size": p.stat().st_size, "sha256": _sha256(p)} for name, p in _files(folder).items()}
    path = folder / MANIFEST
    tmp = path.with_name(f"{MANIFEST}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"titan_ext_version": __version__, "step": step, "files": files}, indent=1))
    os.replace(tmp, path)
    return path


def _listed(manifest: Path) -> dict[str, tuple[int, str]]:
    try:
        body = json.loads(manifest.read_text())
        return {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in body["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UntrustedCheckpoint(f"checkpoint manifest {manifest} is unreadable ({type(e).__name__}): "
                                  f"{_FIX}") from None


def check_step_folder(folder, full: bool = True) -> None:
    """Raise :class:`UntrustedCheckpoint` unless ``folder`` holds a manifest listing exactly its files,
    each of the listed size, and of the listed SHA-256: every file with ``full``, else the
    ``*.metadata`` files only (what DCP unpickles before its first collective)."""
    folder = Path(folder)
    files = _files(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        named = folder / ".metadata" if ".metadata" in files else folder
        raise UntrustedCheckpoint(f"checkpoint {named} has no {MANIFEST} beside it (not saved by titan_ext's "
                                  f"trainer, or its save did not complete): {_FIX}")
    listed = _listed(manifest)
    missing = sorted(set(listed) - set(files))
    if missing:
        raise UntrustedCheckpoint(f"checkpoint file {folder / missing[0]} is listed in {manifest} but missing: "
                                  f"{_FIX}")
    for name, path in files.items():
        if name not in listed:
            raise UntrustedCheckpoint(f"checkpoint file {path} is not listed in {manifest}: {_FIX}")
        size, sha256 = listed[name]
        if path.stat().st_size != size or ((full or name.endswith(".metadata")) and _sha256(path) != sha256):
            raise UntrustedCheckpoint(f"checkpoint file {path} does not match {manifest} (changed after the "
                                      f"save): {_FIX}")


def _is_remote(checkpoint_id) -> bool:
    return "://" in str(checkpoint_id)  # TorchTitan 0.3's and DCP's test for an fsspec URI


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _step_of(checkpoint_id) -> int | None:
    match = re.fullmatch(r"step-(\d+)", Path(checkpoint_id).name)
    return int(match.group(1)) if match else None


def _after(future: Future, checkpoint_id, step: int | None) -> Future:
    """A future that completes like ``future``, after the manifest of ``checkpoint_id`` is written."""
    done: Future = Future()

    def finish(f: Future) -> None:
        try:
            value = f.result()
            write_manifest(checkpoint_id, step)
        except Exception as e:  # noqa: BLE001 - the save's or the manifest's error, raised where TorchTitan waits
            done.set_exception(e)
        else:
            done.set_result(value)

    future.add_done_callback(finish)
    return done


def guard_checkpointer(manager: Any, trust: bool = False) -> None:
    """Wrap ``manager.dcp_save`` (manifest after the save) and ``manager.dcp_load`` (the check before the
    load, skipped with ``trust``) on this instance. A manager without them that is enabled (a checkpoint
    backend other than DCP) is refused with TitanIntegrationError."""
    save, load = getattr(manager, "dcp_save", None), getattr(manager, "dcp_load", None)
    if save is None or load is None:
        if getattr(manager, "enable", False):
            from titan_ext.titan.adapters import TitanIntegrationError

            raise TitanIntegrationError(
                f"checkpoint manager {type(manager).__name__} has no dcp_save/dcp_load: titan_ext cannot check "
                f"its checkpoints before loading them (use TorchTitan's DCP CheckpointManager)")
        return

    def dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        result = save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if to_hf or _is_remote(checkpoint_id) or not _rank0():
            return result
        step = _step_of(checkpoint_id)
        upload = getattr(result, "upload_completion", result)  # async_with_pinned_mem: AsyncSaveResponse
        if not isinstance(upload, Future):  # synchronous: DCP's Metadata, the files are written
            write_manifest(checkpoint_id, step)
            return result
        done = _after(upload, checkpoint_id, step)
        return done if upload is result else dataclasses.replace(result, upload_completion=done)

    def dcp_load(state_dict, checkpoint_id, from_hf, from_quantized):
        if not (trust or from_hf):
            if _is_remote(checkpoint_id):
                raise UntrustedCheckpoint(f"checkpoint {checkpoint_id}: titan_ext checks local checkpoint folders "
                                          f"only; set [titan_ext] trust_checkpoint = true to load a remote one")
            check_step_folder(checkpoint_id, full=_rank0())
        return load(state_dict, checkpoint_id, from_hf, from_quantized)

    manager.dcp_save, manager.dcp_load = dcp_save, dcp_load
