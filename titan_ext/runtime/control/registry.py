"""The schedule registry: one entry per adaptive schedule (in the spirit of TorchTitan's ``TrainSpec`` /
``register_train_spec``).

An entry is a :class:`~titan_ext.runtime.control.parts.ScheduleSpec` — the schedule's name, its config dataclass
(a :class:`~titan_ext.runtime.control.config.AdaptiveConfig` subclass: its own fields are its settings, each
documented by its docstring), the planner it runs with one stage per rank and with several, and its
policies — plus the class made of it (:func:`adaptive_schedule`: the
schedule-neutral coordinator running the entry's parts).  :func:`register_schedule` is the one way in; everything that
looks a schedule up by name reads this registry:

* TorchTitan's ``pipeline_parallel_schedule = "Name"`` (``titan/registry.py``'s ``get_schedule_class``,
  case-insensitive, like torch);
* the ``[titan_ext]`` section: the fields a registered config class adds to ``AdaptiveConfig`` are
  ``[titan_ext]`` knobs of the same name (``titan/config.py``), so a schedule's settings need no table;
* delegation: a transport every adaptive schedule has (``config.delegation``; the schedule's
  ``delegation`` property: ``router``, ``pool``, ``log``, ``set(on)``, ``close()``), not a subclass.

PipeMorph and CrossPipe are registered by their own modules (``runtime/schedules/pipemorph.py``,
``runtime/schedules/crosspipe.py``), and so is a user's schedule (docs/ARCHITECTURE.md, "Adding an adaptive schedule").
"""

from __future__ import annotations

import threading

from titan_ext.args import ArgumentTypeError
from ..adaptive import AdaptiveSchedule
from .parts import ScheduleSpec

__all__ = ["adaptive_schedule", "register_schedule", "registered_schedules", "resolve_schedule_name", "schedule_class",
           "schedule_specs", "unregister_schedule"]

_ENTRIES: dict[str, type[AdaptiveSchedule]] = {}  # name -> the schedule class (its ``spec`` is the entry)
_lock = threading.Lock()


def adaptive_schedule(spec: ScheduleSpec, doc: str | None = None, module: str | None = None) -> type[AdaptiveSchedule]:
    """The schedule class of a registry entry: the coordinator running ``spec``'s planner and policy with
    ``spec.config_class`` (its keywords included).  No code of its own: TorchTitan finds it by name
    (``titan/registry.py``) and its settings through the config (``titan/options.py``)."""
    return type(spec.name, (AdaptiveSchedule,), {"spec": spec, "backward_choices": spec.backward_choices,
                                                 "__doc__": doc or AdaptiveSchedule.__doc__,
                                                 "__module__": module or AdaptiveSchedule.__module__})


def register_schedule(spec: ScheduleSpec, schedule_class: type[AdaptiveSchedule] | None = None, *,
                      module: str | None = None, doc: str | None = None) -> type[AdaptiveSchedule]:
    """Register ``spec`` and return its schedule class: ``schedule_class`` when given (an
    ``AdaptiveSchedule`` subclass whose ``spec`` is ``spec``), else ``adaptive_schedule(spec, doc, module)``.  Registering a
    name again replaces its entry (case-insensitive names are one name)."""
    if not isinstance(spec, ScheduleSpec):
        raise ArgumentTypeError(f"spec must be a ScheduleSpec (register_schedule's entry), got {type(spec).__name__}")
    if schedule_class is None:  # (spec's fields were checked when it was made: ScheduleSpec.__post_init__)
        schedule_class = adaptive_schedule(spec, doc=doc, module=module)
    elif not (isinstance(schedule_class, type) and issubclass(schedule_class, AdaptiveSchedule) and schedule_class.spec is spec):
        raise TypeError(f"schedule {spec.name!r}: schedule_class must be an AdaptiveSchedule subclass with spec = the entry")
    with _lock:
        for name in [n for n in _ENTRIES if n.lower() == spec.name.lower()]:
            del _ENTRIES[name]
        _ENTRIES[spec.name] = schedule_class
    return schedule_class


def unregister_schedule(name: str) -> None:
    """Remove the entry ``name`` (case-insensitive; tests that register a schedule of their own)."""
    with _lock:
        for ours in [n for n in _ENTRIES if n.lower() == name.lower()]:
            del _ENTRIES[ours]


def registered_schedules() -> list[str]:
    """The registered names, in registration order."""
    with _lock:
        return list(_ENTRIES)


def resolve_schedule_name(name: str) -> str | None:
    """The registered spelling of ``name`` (case-insensitive), or None."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a schedule name (text), got {name!r}")
    lowered = name.lower()
    with _lock:
        return next((ours for ours in _ENTRIES if ours.lower() == lowered), None)


def schedule_class(name: str) -> type[AdaptiveSchedule]:
    """The class of the registered schedule ``name`` (case-insensitive); KeyError if none."""
    ours = resolve_schedule_name(name)
    if ours is None:
        raise KeyError(f"no adaptive schedule {name!r} is registered (registered: {registered_schedules()})")
    with _lock:
        return _ENTRIES[ours]


def schedule_specs() -> list[ScheduleSpec]:
    """Every registered entry, in registration order."""
    with _lock:
        return [cls.spec for cls in _ENTRIES.values()]

