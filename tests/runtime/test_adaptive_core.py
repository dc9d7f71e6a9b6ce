"""The schedule-neutral core stays small and neutral: ``AdaptiveSchedule`` within 300 lines and 20
attributes of its own (torch's ``_PipelineScheduleRuntime``: 446 lines, 8 of its own), no schedule's name
in it, and the adaptive schedules equal entries beside each other."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch.distributed.pipelining.schedules as torch_schedules

import titan_ext.runtime.adaptive as adaptive
from titan_ext.runtime import AdaptiveConfig, AdaptiveSchedule, CrossPipe, PipeMorph, registered_schedules, schedule_class

MAX_LINES, MAX_ATTRIBUTES = 300, 20


def _assigned_on_self(tree: ast.AST, classes: set[str]) -> set[str]:
    """Names assigned as ``self.<name> = …`` (plain, annotated, augmented, in tuples) inside ``classes``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in classes):
        for node in ast.walk(cls):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def test_the_coordinator_fits_its_limits():
    source = Path(adaptive.__file__).read_text()
    assert len(source.splitlines()) <= MAX_LINES, len(source.splitlines())
    # torch's own attributes (the action lists, the stage map, the losses it merges) are torch's, not ours
    torch_bases = {c.__name__ for c in AdaptiveSchedule.__mro__[1:] if c.__module__ == torch_schedules.__name__}
    torch_owned = _assigned_on_self(ast.parse(inspect.getsource(torch_schedules)), torch_bases)
    assert {"pipeline_order", "pipeline_order_with_comms", "stage_index_to_group_rank"} <= torch_owned
    ours = _assigned_on_self(ast.parse(source), {"AdaptiveSchedule"}) - torch_owned
    assert len(ours) <= MAX_ATTRIBUTES, sorted(ours)
    assert len(ours) >= 10, sorted(ours)  # the scan sees the coordinator's parts (config, parts, lifecycle …)


def test_the_coordinator_names_no_schedule():
    """No planner or schedule by name in the core: what differs is the registry entry."""
    code = "\n".join(line.split("#")[0] for line in Path(adaptive.__file__).read_text().splitlines()
                     if not line.lstrip().startswith(('"""', "``")))
    for name in ("PipeMorphPlanner", "CrossPipePlanner", "PIPEMORPH", "CROSSPIPE", "PipeMorphConfig", "CrossPipeConfig"):
        assert name not in code, name


def test_pipemorph_and_crosspipe_are_entries_beside_each_other():
    assert registered_schedules()[:2] == ["PipeMorph", "CrossPipe"]
    for cls in (PipeMorph, CrossPipe):
        assert cls.__bases__ == (AdaptiveSchedule,), cls.__mro__
        assert schedule_class(cls.__name__) is cls
        assert issubclass(cls.spec.config_class, AdaptiveConfig)
        assert callable(cls.spec.one_stage_planner) and callable(cls.spec.one_stage_policy)
    assert not issubclass(CrossPipe, PipeMorph) and not issubclass(PipeMorph, CrossPipe)
    assert not issubclass(CrossPipe.spec.config_class, PipeMorph.spec.config_class)
    assert CrossPipe.spec.one_stage_planner is not PipeMorph.spec.one_stage_planner


def test_the_core_without_an_entry_is_refused():
    try:
        AdaptiveSchedule([], 4)
    except TypeError as exc:
        assert "registry entry" in str(exc)
    else:
        raise AssertionError("AdaptiveSchedule without a registry entry was built")
