"""One adapter per TorchTitan version (titan_ext/titan/adapters/): chosen by the installed version,
and a loud failure -- naming what is missing -- for an unknown version or a renamed hook."""

import importlib
from types import ModuleType

import pytest

from titan_ext.titan import adapters


@pytest.mark.parametrize("version,module", [
    ("0.2.2", "titan_ext.titan.adapters.tt02"),
    ("0.2.9+git", "titan_ext.titan.adapters.tt02"),
    ("0.3.0", "titan_ext.titan.adapters.tt03"),
    ("0.3.1", "titan_ext.titan.adapters.tt03"),
])
def test_adapter_chosen_by_torchtitan_version(version, module):
    assert adapters.adapter_for(version) == module


@pytest.mark.parametrize("version", ["0.1.0", "0.4.0", "1.0.0"])
def test_unknown_torchtitan_version_is_refused_naming_the_supported_ones(version):
    with pytest.raises(adapters.TitanIntegrationError, match=rf"no adapter for TorchTitan {version}.*0\.2\.x, 0\.3\.x"):
        adapters.adapter_for(version)


def test_installed_torchtitan_gets_its_adapter_with_every_hook():
    import torchtitan  # noqa: F401

    adapter = adapters.current()
    assert adapter.__name__ == adapters.adapter_for(adapters.torchtitan_version())
    assert adapters.missing_hooks(adapter) == []
    assert adapter.trainer_base().__name__ == "Trainer"
    pipeline = importlib.import_module(adapter.PIPELINE)
    # registration wrapped every builder hook the adapter names
    from titan_ext.titan import register

    register(cpu_shim=False)
    for name in adapter.WRAPPERS:
        assert getattr(getattr(pipeline, name), "_titan_ext_wrapped", False), name


def test_a_renamed_hook_is_named():
    fake = ModuleType("fake_adapter")
    fake.HOOKS = (("torchtitan.distributed.pipeline_parallel", "build_pipeline_schedule_renamed"),
                  ("torchtitan.no_such_module", "x"), ("torchtitan.components.metrics", "MetricsProcessor"))
    assert adapters.missing_hooks(fake) == [
        "torchtitan.distributed.pipeline_parallel.build_pipeline_schedule_renamed", "torchtitan.no_such_module"]


@pytest.mark.parametrize("damage", ["renamed_hook", "unknown_version"])
def test_registration_fails_loudly(monkeypatch, damage):
    """``register()`` (what ``import titan_ext`` runs under TorchTitan) refuses to go on, naming what
    is missing, when a hook of the installed TorchTitan is gone or its version is unknown."""
    from titan_ext.titan import registry

    adapter = adapters.current()
    monkeypatch.setattr(adapters, "_current", None)
    if damage == "renamed_hook":
        name = next(iter(adapter.WRAPPERS))
        monkeypatch.delattr(importlib.import_module(adapter.PIPELINE), name)
        want = f"missing {adapter.PIPELINE}.{name}"
    else:
        monkeypatch.setattr(adapters, "torchtitan_version", lambda: "0.9.0")
        want = "no adapter for TorchTitan 0.9.0"
    with pytest.raises(adapters.TitanIntegrationError, match=want):
        registry.register(cpu_shim=False)
