"""Every TorchTitan symbol titan_ext uses is a row of its adapter's ``CONTRACT`` (titan/adapters/),
checked at registration: the installed TorchTitan's contract holds, and a synthetic next release --
each symbol upstream TorchTitan removed after 0.3.0, taken away one at a time -- is refused naming
exactly that symbol and the version. The table of the version not installed is checked statically."""

import dataclasses
import importlib
import importlib.util

import pytest

pytest.importorskip("torchtitan")

from titan_ext.titan import adapters  # noqa: E402
from titan_ext.titan.adapters import tt02, tt03  # noqa: E402

TABLES = {"0.2": tt02, "0.3": tt03}
VERSION = adapters.torchtitan_version()
PIPELINE = "torchtitan.distributed.pipeline_parallel"


def _live(version: str) -> None:
    """Skip unless TorchTitan ``version``.x is the installed one."""
    if adapters.adapter_for(VERSION) != TABLES[version].__name__:
        pytest.skip(f"TorchTitan {VERSION} is installed, not {version}.x: the {version} table is checked "
                    f"statically only (test_contract_table_is_well_formed)")


# -- the synthetic next release: one removal each, (module, name, kind, symbol) of the row it breaks per
# version (0.2 lacks the 0.3-only symbols: the same kind of removal of a 0.2 symbol stands in) ---------

ROWS = {
    "DatasetConfig": {v: ("torchtitan.hf_datasets", "DatasetConfig", "fields", None) for v in TABLES},
    "batch_size_fields": {"0.2": ("torchtitan.config.job_config", "Training", "fields", "global_batch_size"),
                          "0.3": ("torchtitan.config", "TrainingConfig", "fields", "global_batch_size")},
    "data_loader_class": {"0.2": ("torchtitan.config", "ConfigManager.parse_args", "callable", None),
                          "0.3": ("torchtitan.hf_datasets.text_datasets", "HuggingFaceTextDataLoader.Config",
                                  "fields", None)},
    "trainer_attribute": {"0.2": ("torchtitan.train", "Trainer", "instance_attr", "gradient_accumulation_steps"),
                          "0.3": ("torchtitan.trainer", "Trainer", "instance_attr",
                                  "num_pipeline_parallel_microbatches")},
    "builder_parameter": {"0.2": (PIPELINE, "build_pipeline_schedule", "callable", "job_config"),
                          "0.3": (PIPELINE, "_build_pipeline_schedule", "callable", "local_batch_size")},
}


def _remove_dataset_config(monkeypatch, version, tmp_path):
    monkeypatch.delattr(importlib.import_module("torchtitan.hf_datasets"), "DatasetConfig")
    return "missing", ["torchtitan.hf_datasets.DatasetConfig"]


def _drop_batch_size_fields(monkeypatch, version, tmp_path):
    """The config dataclass replaced by one without the batch sizes."""
    module, name, _, _ = ROWS["batch_size_fields"][version]
    mod = importlib.import_module(module)
    gone = ("local_batch_size", "global_batch_size")
    kept = [(f.name, f.type) for f in dataclasses.fields(getattr(mod, name)) if f.name not in gone]
    monkeypatch.setattr(mod, name, dataclasses.make_dataclass(name, kept))
    return "fields", [f"{module}.{name} has no field {f!r}" for f in gone]


def _remove_data_loader_class(monkeypatch, version, tmp_path):
    module, name, _, _ = ROWS["data_loader_class"][version]
    cls = name.split(".")[0]
    monkeypatch.delattr(importlib.import_module(module), cls)
    return "missing", [f"{module}.{cls}"]


def _trainer_without_attribute(monkeypatch, version, tmp_path):
    """``Trainer.__init__`` replaced by one (in a file: its source is read) that sets every other
    attribute of the contract's row."""
    module, name, kind, gone = ROWS["trainer_attribute"][version]
    (attrs,) = [d for m, n, k, d in TABLES[version].CONTRACT if (m, n, k) == (module, name, kind)]
    path = tmp_path / "next_trainer.py"
    path.write_text("def __init__(self, config):\n" + "".join(f"    self.{a} = None\n" for a in attrs if a != gone))
    spec = importlib.util.spec_from_file_location("next_trainer", path)
    next_trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(next_trainer)
    monkeypatch.setattr(getattr(importlib.import_module(module), name), "__init__", next_trainer.__init__)
    return "instance_attr", [f"{module}.{name}.__init__ sets no self.{gone}"]


def _rename_builder_parameter(monkeypatch, version, tmp_path):
    pipeline = importlib.import_module(PIPELINE)
    if version == "0.3":  # upstream main: num_microbatches instead of local_batch_size
        def _build_pipeline_schedule(*, parallelism, num_microbatches, stages, loss_fn,
                                     backward_requires_autograd=True):
            raise AssertionError("never called")

        monkeypatch.setattr(pipeline, "_build_pipeline_schedule", _build_pipeline_schedule)
        return "callable", [f"{PIPELINE}._build_pipeline_schedule has no parameter 'local_batch_size' (its "
                            f"parameters: parallelism, num_microbatches, stages, loss_fn, backward_requires_autograd)"]

    def build_pipeline_schedule(config, stages, loss_fn):
        raise AssertionError("never called")

    monkeypatch.setattr(pipeline, "build_pipeline_schedule", build_pipeline_schedule)
    return "callable", [f"{PIPELINE}.build_pipeline_schedule has no parameter 'job_config' (its parameters: "
                        f"config, stages, loss_fn)"]


REMOVALS = {"DatasetConfig": _remove_dataset_config, "batch_size_fields": _drop_batch_size_fields,
            "data_loader_class": _remove_data_loader_class, "trainer_attribute": _trainer_without_attribute,
            "builder_parameter": _rename_builder_parameter}


def _flat(detail) -> tuple:
    return detail[0] if isinstance(detail, tuple) and len(detail) == 2 and isinstance(detail[1], bool) else detail


@pytest.mark.parametrize("version", sorted(TABLES))
def test_contract_table_is_well_formed(version):
    """Static (no TorchTitan of that version needed): well-formed rows, the HOOKS / SIGNATURES views
    derived from them, and a row for each symbol the synthetic next release removes."""
    adapter = TABLES[version]
    assert adapters.malformed_rows(adapter.CONTRACT) == []
    assert adapter.SIGNATURES == {(m, n): d for m, n, k, d in adapter.CONTRACT if k == "callable"}
    assert set(adapter.HOOKS) == {(m, n.split(".")[0]) for m, n, _, _ in adapter.CONTRACT}
    assert adapters.contract(adapter) == adapter.CONTRACT
    for removal, rows in ROWS.items():
        module, name, kind, symbol = rows[version]
        assert any((m, n, k) == (module, name, kind) and (symbol is None or symbol in _flat(d))
                   for m, n, k, d in adapter.CONTRACT), (removal, rows[version])


def test_malformed_rows_are_named():
    rows = (("torchtitan.x", "A", "attr", None), ("torchtitan.x", "A", "attr", None),
            ("torchtitan.x", "B", "method", None), ("torchtitan.x", "C", "fields", ()),
            ("torchtitan.x", "D", "callable", (("a",), "yes")), ("fake", "E", "attr", None), ("short",))
    lines = adapters.malformed_rows(rows)
    assert len(lines) == 6
    assert "listed twice" in lines[0] and "kind 'method'" in lines[1]
    assert "does not fit kind 'fields'" in lines[2] and "does not fit kind 'callable'" in lines[3]
    assert "module 'fake' is not a torchtitan module path" in lines[4] and "not a (module" in lines[5]


@pytest.mark.parametrize("version", sorted(TABLES))
def test_installed_torchtitan_keeps_the_contract(version):
    _live(version)
    adapter = TABLES[version]
    problems = adapters.contract_problems(adapter)
    assert problems == {kind: [] for kind in problems}
    assert adapters.check_adapter(adapter, VERSION) is True
    assert adapters.current() is adapter


@pytest.mark.parametrize("version", sorted(TABLES))
@pytest.mark.parametrize("removal", sorted(REMOVALS))
def test_a_release_without_a_symbol_is_refused_naming_it(monkeypatch, tmp_path, removal, version):
    """Each removal breaks exactly its row: TitanIntegrationError names that symbol and the version."""
    _live(version)
    adapter = TABLES[version]
    kind, lines = REMOVALS[removal](monkeypatch, version, tmp_path)
    problems = adapters.contract_problems(adapter)
    assert problems == {k: (lines if k == kind else []) for k in problems}
    with pytest.raises(adapters.TitanIntegrationError) as info:
        adapters.check_adapter(adapter, VERSION)
    message = str(info.value)
    assert message.startswith(f"titan_ext cannot attach to TorchTitan {VERSION}: ")
    assert all(line in message for line in lines), message


def test_registration_refuses_a_release_without_a_symbol(monkeypatch, tmp_path):
    """``register()`` (``import titan_ext`` under TorchTitan) runs the check before anything else of the
    job: the symbol's absence is named there, not met as an ImportError when the dataset registers."""
    from titan_ext.titan import registry

    monkeypatch.setattr(adapters, "_current", None)
    version = adapters.current().VERSION
    monkeypatch.setattr(adapters, "_current", None)
    _remove_dataset_config(monkeypatch, version, tmp_path)
    with pytest.raises(adapters.TitanIntegrationError,
                       match=rf"TorchTitan {VERSION}: missing torchtitan\.hf_datasets\.DatasetConfig "):
        registry.register(cpu_shim=False)
