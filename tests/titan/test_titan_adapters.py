"""One adapter per TorchTitan version (titan_ext/titan/adapters/): chosen by the installed version,
and a loud failure -- naming what is missing -- for an unknown version or a renamed hook."""

import importlib
import inspect
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


def test_tt03_falcon_chunks_join_a_forward_backwards_items_and_give_them_back_in_order():
    """Under 0.3 a Falcon chunk is what one forward/backward reads (num_pipeline_parallel_microbatches
    data-loader items), joined into one (input_dict, labels) pair for S2's exchange; the trainer gets
    exactly the items back, in order (the adapter module imports no TorchTitan: tested everywhere)."""
    import torch
    from types import SimpleNamespace

    from titan_ext.titan.adapters import tt03

    items = [({"input": torch.full((1, 3), float(i))}, torch.full((1, 3), -float(i))) for i in range(6)]
    seen_chunks, fed = [], []

    def job_step(run_step, chunks):
        mine = [next(chunks) for _ in range(3)]
        seen_chunks.extend(mine)
        run_step(iter(mine))

    job = SimpleNamespace(trainer=SimpleNamespace(num_pipeline_parallel_microbatches=2), train_step=job_step)
    tt03.falcon_train_step(job, lambda it: fed.extend(it), iter(items))
    assert [c[0]["input"].shape for c in seen_chunks] == [torch.Size([2, 3])] * 3
    assert torch.equal(seen_chunks[1][1], torch.tensor([[-2.0] * 3, [-3.0] * 3]))
    assert len(fed) == 6 and all(torch.equal(a[0]["input"], b[0]["input"]) and torch.equal(a[1], b[1])
                                 for a, b in zip(fed, items))


def test_tt03_dp_replicas_summed_by_the_trainer_need_partial_dtensor():
    """0.3's default spmd_backend reduces gradients over DP inside the backward: Falcon's trainer-owned
    sum (and S2) would be wrong there, so it is refused naming the key; with partial_dtensor the model's
    parallelize_fn sees no dp_replicate (FSDP over the size-1 fsdp mesh)."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from titan_ext.titan.adapters import tt03

    seen = []

    @dataclass
    class Spec:
        parallelize_fn: object

    config = SimpleNamespace(model_spec=Spec(lambda model, *, parallel_dims, **kw: seen.append(parallel_dims)))
    tt03.install_replication_by_trainer(config)
    tt03.install_replication_by_trainer(config)  # idempotent
    dims = SimpleNamespace(pp_enabled=True, dp_replicate_enabled=True, fsdp_enabled=False)
    with pytest.raises(adapters.TitanIntegrationError, match=r"spmd_backend = 'partial_dtensor' \(got 'spmd_types'"):
        config.model_spec.parallelize_fn(None, parallel_dims=dims, parallelism=SimpleNamespace(spmd_backend="spmd_types"))
    config.model_spec.parallelize_fn(None, parallel_dims=dims, parallelism=SimpleNamespace(spmd_backend="partial_dtensor"))
    assert seen[-1].dp_replicate_enabled is False and seen[-1].pp_enabled is True
    pp_only = SimpleNamespace(pp_enabled=True, dp_replicate_enabled=False, fsdp_enabled=False)
    config.model_spec.parallelize_fn(None, parallel_dims=pp_only, parallelism=SimpleNamespace(spmd_backend="spmd_types"))
    assert seen[-1] is pp_only  # nothing replicated by the trainer: TorchTitan's own path untouched


def _fake_torchtitan_module(monkeypatch, **hooks):
    import sys

    module = ModuleType("fake_torchtitan_pipeline")
    for name, hook in hooks.items():
        setattr(module, name, hook)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_a_hook_with_a_renamed_parameter_is_named(monkeypatch):
    """TorchTitan's main branch calls ``_build_pipeline_schedule`` with ``num_microbatches`` instead of
    ``local_batch_size``: the 0.3 adapter's signature names that at registration."""
    from titan_ext.titan.adapters import tt03

    def _build_pipeline_schedule(*, parallelism, num_microbatches, stages, loss_fn,
                                 backward_requires_autograd=True):
        raise AssertionError("never called")

    module = _fake_torchtitan_module(monkeypatch, _build_pipeline_schedule=_build_pipeline_schedule)
    fake = ModuleType("fake_adapter")
    fake.HOOKS = ((module, "_build_pipeline_schedule"),)
    fake.SIGNATURES = {(module, "_build_pipeline_schedule"): tt03.SIGNATURES[(tt03.PIPELINE, "_build_pipeline_schedule")]}
    (line,) = adapters.signature_mismatches(fake)
    assert f"{module}._build_pipeline_schedule has no parameter 'local_batch_size'" in line
    assert "num_microbatches" in line  # what it has instead
    with pytest.raises(adapters.TitanIntegrationError, match=r"_build_pipeline_schedule has no parameter 'local_batch_size'"):
        adapters.check_adapter(fake, "0.3.99")


def test_a_positional_hook_with_its_parameters_reordered_is_named(monkeypatch):
    def build_pipeline_schedule(stages, job_config, loss_fn):
        raise AssertionError("never called")

    module = _fake_torchtitan_module(monkeypatch, build_pipeline_schedule=build_pipeline_schedule)
    fake = ModuleType("fake_adapter")
    fake.SIGNATURES = {(module, "build_pipeline_schedule"): (("job_config", "stages", "loss_fn"), True)}
    assert adapters.signature_mismatches(fake) == [
        f"{module}.build_pipeline_schedule: parameter 'job_config' is not its positional parameter 1 "
        f"(its parameters: stages, job_config, loss_fn)",
        f"{module}.build_pipeline_schedule: parameter 'stages' is not its positional parameter 2 "
        f"(its parameters: stages, job_config, loss_fn)"]


def test_installed_torchtitan_hooks_fit_their_signatures():
    adapter = adapters.current()
    assert adapter.SIGNATURES and adapters.signature_mismatches(adapter) == []


def test_registration_fails_naming_a_hook_whose_signature_changed(monkeypatch):
    """``register()`` stops with TitanIntegrationError naming the hook and the parameter, before any
    training (not a TypeError when TorchTitan first calls our wrapper)."""
    from titan_ext.titan import registry

    adapter = adapters.current()
    monkeypatch.setattr(adapters, "_current", None)
    (module, attribute), (params, _) = next(iter(adapter.SIGNATURES.items()))
    renamed = params[-1]

    def drifted(*args, **kwargs):
        raise AssertionError("never called")

    drifted.__signature__ = inspect.Signature(
        [inspect.Parameter(p if p != renamed else p + "_v2", inspect.Parameter.KEYWORD_ONLY)
         for p in params])
    monkeypatch.setattr(importlib.import_module(module), attribute, drifted)
    with pytest.raises(adapters.TitanIntegrationError, match=rf"{attribute} has no parameter '{renamed}'"):
        registry.register(cpu_shim=False)
