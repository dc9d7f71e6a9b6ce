"""Nothing titan_ext loads runs code: Falcon's stage checkpoints are read with ``weights_only=True``, and
TorchTitan's DCP checkpoints are loaded only with a matching manifest (titan/checkpoint_guard.py).

Every case plants a crafted pickle whose ``__reduce__`` calls ``os.system`` to create a marker file, and
checks the marker never appears. The DCP cases save and load through TorchTitan's own
``CheckpointManager`` (either version), guarded as ``TitanExtTrainer`` guards it, in this process
without a process group (DCP then works on one rank)."""

import hashlib
import json
import os
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import titan_ext
from titan_ext.runtime.falcon.restart import load_stage_checkpoint, save_stage_checkpoint
from titan_ext.titan import adapters
from titan_ext.titan.checkpoint_guard import (
    MANIFEST,
    UntrustedCheckpoint,
    check_step_folder,
    guard_checkpointer,
    write_manifest,
)
from titan_ext.titan import falcon_s4 as s4


class _Crafted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _State:
    """A Stateful holding tensors (stands in for the optimizer, LR schedulers, data loader)."""

    def __init__(self, seed: int):
        self.sd = {"t": torch.randn(3, generator=torch.Generator().manual_seed(seed))}

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = {k: v.clone() for k, v in sd.items()}


class _TrainState:
    def __init__(self, step: int):
        self.step = step

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def _manager(base: Path, seed: int, trust: bool = False):
    """TorchTitan's DCP CheckpointManager over a small model (and stand-in states), guarded."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    parts = dict(dataloader=_State(seed), model_parts=[model], optimizers=_State(seed + 1),
                 lr_schedulers=_State(seed + 2), states={"train_state": _TrainState(seed)}, sd_adapter=None,
                 base_folder=str(base))
    if adapters.torchtitan_version().startswith("0.2"):
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.config import Checkpoint

        manager = CheckpointManager(checkpoint_config=Checkpoint(enable=True, interval=1, keep_latest_k=0), **parts)
    else:
        from torchtitan.components.checkpointer import CheckpointManager

        manager = CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0).build(**parts)
    guard_checkpointer(manager, trust=trust)
    return manager, model, parts


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of step 3 saved by a guarded manager: (its step folder, the saved model)."""
    manager, model, _ = _manager(tmp_path, seed=1)
    manager.save(3)
    return tmp_path / "checkpoint" / "step-3", model


def test_the_crafted_pickle_runs_when_unpickled_plainly(tmp_path):
    """The control: the payload the other tests plant does create the marker (DCP's ``.metadata`` reader
    is a plain ``pickle.load``)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Crafted(marker)))
    assert marker.exists()


# ---------------------------------------------------------------------------------- Falcon stage files
def _stage_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return model, opt


def test_stage_checkpoint_round_trip_needs_no_allowlist(tmp_path):
    model, opt = _stage_model()
    save_stage_checkpoint(tmp_path, 0, model, opt, step=7, extra={"grid": [[0, 1]], "why": "s3"})
    other = torch.nn.Linear(3, 3)
    other_opt = torch.optim.AdamW(other.parameters())
    state = load_stage_checkpoint(tmp_path, 0, other, other_opt)
    assert state["step"] == 7 and state["extra"] == {"grid": [[0, 1]], "why": "s3"}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_crafted_stage_checkpoint_is_refused_in_one_line_and_never_runs(tmp_path, writer):
    marker = tmp_path / "ran"
    path = tmp_path / "falcon_stage0.pt"
    state = {"stage": 0, "step": 0, "model": {}, "optimizer": None, "extra": _Crafted(marker)}
    if writer == "pickle":
        path.write_bytes(pickle.dumps(state))
    else:
        torch.save(state, path)
    with pytest.raises(ValueError) as exc:
        load_stage_checkpoint(tmp_path, 0, torch.nn.Linear(3, 3))
    assert str(path) in _one_line(exc) and "refused" in str(exc.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------------- DCP checkpoints
def test_a_save_writes_the_manifest_and_a_good_checkpoint_loads_equal(tmp_path, saved):
    folder, model = saved
    manifest = json.loads((folder / MANIFEST).read_text())
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert ".metadata" in files and sorted(manifest["files"]) == files
    assert manifest["step"] == 3 and manifest["titan_ext_version"] == titan_ext.__version__
    for name in files:
        data = (folder / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    manager, fresh, parts = _manager(tmp_path, seed=2)
    assert manager.load() is True
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert parts["states"]["train_state"].step == 1  # the saved manager's (seed 1)
    assert torch.equal(parts["optimizers"].sd["t"], _State(2).sd["t"])


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_crafted_file_in_a_step_folder_is_refused_before_it_is_unpickled(tmp_path, saved, name):
    folder, _ = saved
    marker = tmp_path / "ran"
    (folder / name).write_bytes(pickle.dumps(_Crafted(marker)))
    manager, _, _ = _manager(tmp_path, seed=2)
    with pytest.raises(UntrustedCheckpoint) as exc:
        manager.load()
    assert str(folder / name) in _one_line(exc) and "trust_checkpoint" in str(exc.value)
    assert not marker.exists()


def test_a_step_folder_without_manifest_is_refused(tmp_path, saved):
    folder, _ = saved
    (folder / MANIFEST).unlink()
    manager, _, _ = _manager(tmp_path, seed=2)
    with pytest.raises(UntrustedCheckpoint) as exc:
        manager.load()
    assert f"{folder / '.metadata'} has no {MANIFEST}" in _one_line(exc)

    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Crafted(marker)))
    with pytest.raises(UntrustedCheckpoint):
        manager.load()
    assert not marker.exists()


def test_trust_checkpoint_loads_a_folder_without_manifest(tmp_path, saved):
    folder, model = saved
    (folder / MANIFEST).unlink()
    manager, fresh, _ = _manager(tmp_path, seed=2, trust=True)
    assert manager.load() is True
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_unlisted_missing_or_unreadable_manifest_entries_are_refused(saved):
    folder, _ = saved
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(UntrustedCheckpoint, match="extra.bin is not listed"):
        check_step_folder(folder)
    (folder / "extra.bin").unlink()
    (folder / "__0_0.distcp").rename(folder / "moved")
    with pytest.raises(UntrustedCheckpoint, match="listed in .* but missing"):
        check_step_folder(folder)
    (folder / "moved").rename(folder / "__0_0.distcp")
    (folder / MANIFEST).write_text('{"files": [1]}')
    with pytest.raises(UntrustedCheckpoint, match="is unreadable"):
        check_step_folder(folder)


def test_other_ranks_hash_only_metadata_and_compare_sizes(saved):
    """What a rank other than 0 checks (rank 0 hashes every file: the cost model of the docstring)."""
    folder, _ = saved
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    check_step_folder(folder, full=False)  # same size: left to rank 0
    with pytest.raises(UntrustedCheckpoint, match="does not match"):
        check_step_folder(folder, full=True)
    data.write_bytes(bytes(raw) + b"x")
    with pytest.raises(UntrustedCheckpoint, match="does not match"):
        check_step_folder(folder, full=False)


class _FakeManager:
    """dcp_save / dcp_load with TorchTitan's signatures; the save completes when the test says so."""

    enable = True

    def __init__(self, pinned: bool):
        self.pinned, self.upload = pinned, Future()

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        dcp.save(state_dict, checkpoint_id=checkpoint_id, no_dist=True)
        if self.pinned:
            staged = Future()
            staged.set_result(None)
            return AsyncSaveResponse(staging_completion=staged, upload_completion=self.upload)
        return self.upload

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        dcp.load(state_dict, checkpoint_id=checkpoint_id, no_dist=True)


@pytest.mark.parametrize("pinned", [False, True], ids=["async", "async_with_pinned_mem"])
def test_an_async_save_is_done_only_after_its_manifest(tmp_path, pinned):
    manager = _FakeManager(pinned)
    guard_checkpointer(manager)
    folder = tmp_path / "step-5"
    result = manager.dcp_save({"w": torch.ones(2)}, checkpoint_id=str(folder), async_mode="async")
    waited = result.upload_completion if pinned else result
    assert isinstance(result, AsyncSaveResponse) == pinned and not waited.done()
    assert not (folder / MANIFEST).exists()
    manager.upload.set_result("metadata")
    assert waited.result(timeout=5) == "metadata"
    assert json.loads((folder / MANIFEST).read_text())["step"] == 5
    check_step_folder(folder)


def test_a_failed_async_save_gets_no_manifest_and_fails_where_torchtitan_waits(tmp_path):
    manager = _FakeManager(pinned=False)
    guard_checkpointer(manager)
    folder = tmp_path / "step-5"
    result = manager.dcp_save({"w": torch.ones(2)}, checkpoint_id=str(folder), async_mode="async")
    manager.upload.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        result.result(timeout=5)
    assert not (folder / MANIFEST).exists()


def test_hf_loads_are_not_checked_and_remote_folders_are_refused_unless_trusted(tmp_path):
    manager = _FakeManager(pinned=False)
    manager.dcp_load = lambda *args: "loaded"
    guard_checkpointer(manager)
    assert manager.dcp_load({}, str(tmp_path / "hf"), True, False) == "loaded"  # DCP's HF reader: no pickle
    with pytest.raises(UntrustedCheckpoint, match="local checkpoint folders only") as exc:
        manager.dcp_load({}, "gs://bucket/checkpoint/step-3", False, False)
    _one_line(exc)
    trusted = _FakeManager(pinned=False)
    trusted.dcp_load = lambda *args: "loaded"
    guard_checkpointer(trusted, trust=True)
    assert trusted.dcp_load({}, "gs://bucket/checkpoint/step-3", False, False) == "loaded"


def test_a_manager_without_dcp_methods_is_refused_only_when_enabled():
    class Other:
        enable = True

    with pytest.raises(adapters.TitanIntegrationError, match="has no dcp_save/dcp_load"):
        guard_checkpointer(Other())
    Other.enable = False
    guard_checkpointer(Other())


def test_write_manifest_lists_nested_files(tmp_path):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "a.safetensors").write_bytes(b"abc")
    (tmp_path / ".metadata").write_bytes(b"m")
    body = json.loads(write_manifest(tmp_path, None).read_text())
    assert sorted(body["files"]) == [".metadata", "sharded/a.safetensors"] and body["step"] is None
    check_step_folder(tmp_path)


@pytest.mark.parametrize("version", ["0.2", "0.3"])
def test_s4_waits_for_the_async_save_and_its_manifest_before_exit(version):
    calls = []

    class Checkpointer:
        interval = 10

        def save(self, step, last_step=False):
            calls.append(("save", step, self.interval))

    if version == "0.2":
        Checkpointer._async_wait = lambda self: calls.append("wait")
    else:
        Checkpointer.maybe_wait_for_saving = lambda self: calls.append("wait")
    trainer = type("Trainer", (), {"checkpointer": Checkpointer()})()
    s4._save_checkpoint(trainer, 4)
    assert calls == [("save", 4, 1), "wait"] and trainer.checkpointer.interval == 10
