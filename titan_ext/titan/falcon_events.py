"""Falcon's record in the DP x PP job: one ``falcon_events.jsonl`` row per event,
localisation, decision and outcome (:func:`event_rows`), a console line each, the step's decision
dict in ``falcon.jsonl``, and the same rows on W&B (:class:`EventLog`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

from titan_ext.titan.appendlog import LineLog
from titan_ext.runtime.falcon.files import FALCON_EVENTS, FALCON_LOG

__all__ = ["STRATEGY_LABEL", "event_rows", "EventLog"]

STRATEGY_LABEL = {"ignore": "S1", "microbatch_redistribution": "S2", "topology_adjustment": "S3",
                  "checkpoint_restart": "S4", "pipemorph_replan": "PipeMorph"}
"""Falcon §5.1's levels (S1 ignore, S2 micro-batch adjustment, S3 topology adjustment, S4
checkpoint-and-restart); PipeMorph's re-plan is the PP-link mitigation between S1 and S3."""


def event_rows(step: int, decision: dict, monitor: Any, estimated: Any, applied_s: dict[str, float | None],
               apply_decisions: bool, observed_step: int | None = None) -> list[dict]:
    """The ``falcon_events.jsonl`` rows of one step's ``falcon/*`` decision dict (see FALCON_EVENTS).
    ``step``: the step at whose end the decision was taken and applied (a check of the job's: its
    changes are in force from the next step); ``observed_step``: the step whose numbers decided
    (None: ``step``; earlier where checks are ``falcon_check_every`` > 1 steps apart), each row's
    ``observed_step``.  ``estimated``: the costs Alg. 1 decided with (before an application
    re-measured one); ``applied_s``: strategy → its measured cost, for those applied (None: measured
    later, S4's by the restarted job)."""
    rows = _event_rows(step, decision, monitor, estimated, applied_s, apply_decisions)
    observed = step if observed_step is None else observed_step
    return [{**r, "observed_step": observed} for r in rows]


def _event_rows(step: int, decision: dict, monitor: Any, estimated: Any, applied_s: dict[str, float | None],
                apply_decisions: bool) -> list[dict]:
    rows: list[dict] = []
    if "falcon/event" in decision:
        rows.append({"kind": "event", "iteration": step, "event": decision["falcon/event"],
                     "change_point_iteration": decision.get("falcon/change_point_iteration"),
                     "change_point_step": decision.get("falcon/change_point_step"),
                     "located_by": decision.get("falcon/change_point_group", "iteration_time"),
                     "iteration_time_s": decision.get("falcon/iteration_time_s"),
                     "evidence": {"relative_change": decision.get("falcon/change_point_relative_change"),
                                  "latency_iters": decision.get("falcon/change_point_latency_iters"),
                                  "cp_probability": decision.get("falcon/cp_probability")}})
    suspected = {"root_cause": monitor.root_cause, "component": getattr(monitor, "root_component", None),
                 "slow_devices": list(monitor.slow_devices),
                 "slow_links": [list(link) for link in monitor.slow_links],
                 "suspicious_groups": list(monitor.suspicious)}
    if "falcon/root_cause" in decision:
        # §4.3's evidence: each slow component with its cause and its measure (a link's excess
        # time over the reference, a device's probe slowdown), whether this event handled it already
        rows.append({"kind": "localised", "iteration": step, "suspected": suspected,
                     "validation_pause_s": decision.get("falcon/validation_pause_s"),
                     "evidence": {"components": list(getattr(monitor, "attribution", [])),
                                  "validation_pause_s": decision.get("falcon/validation_pause_s")}})
    before = decision.get("falcon/iteration_time_s")
    for name in filter(None, decision.get("falcon/apply", "").split(",")):
        applied = apply_decisions and name in applied_s
        rows.append({"kind": "decision", "iteration": step, "suspected": suspected,
                     "strategy": STRATEGY_LABEL.get(name, name), "name": name, "applied": applied,
                     "estimated_cost_s": estimated.of(name),
                     "measured_cost_s": applied_s.get(name) if applied else None,
                     "impact_s": decision.get("falcon/impact_s"), "iteration_time_before_s": before,
                     "iteration_time_predicted_s": decision.get(f"falcon/predicted_s/{name}"),
                     # Alg. 1's evidence (§5.2): the impact accumulated since the onset reached the
                     # strategy's cost, for this component
                     "evidence": {"impact_s": decision.get("falcon/impact_s"),
                                  "estimated_cost_s": estimated.of(name), "component": suspected["component"],
                                  "iteration_time_predicted_s": decision.get(f"falcon/predicted_s/{name}")}})
    for key, effect in decision.items():
        if key.startswith("falcon/effect/") and key.count("/") == 2:
            name = key.split("/")[2]
            rows.append({"kind": "outcome", "iteration": step, "strategy": STRATEGY_LABEL.get(name, name),
                         "name": name, "effect": effect,
                         "iteration_time_before_s": decision.get(f"{key}/before_s"),
                         "iteration_time_after_s": decision.get(f"{key}/after_s")})
    return rows


def _console(row: dict) -> str:
    head = f"{row['kind']} at step {row['iteration']}"
    if row["kind"] == "decision":
        cost = row["measured_cost_s"]
        return (f"{head}: {row['strategy']} ({row['name']}) for {row['suspected']['root_cause']}, "
                f"{'applied' if row['applied'] else 'not applied'}, estimated cost "
                f"{row['estimated_cost_s']:.3g} s" + (f", measured {cost:.3g} s" if cost is not None else ""))
    if row["kind"] == "outcome":
        return (f"{head}: {row['strategy']} ({row['name']}) iteration "
                f"{row['iteration_time_before_s']:.3f} s -> {row['iteration_time_after_s']:.3f} s")
    if row["kind"] == "localised":
        return f"{head}: suspected {row['suspected']}"
    return (f"{head}: {row['event']} (change point at step {row['change_point_step']}, located by "
            f"{row['located_by']})")


class EventLog:
    """The rows of a job: files and console on rank 0, W&B on the rank that holds TorchTitan's W&B
    logger (the metrics rank: every rank has the same rows)."""

    def __init__(self, trainer: Any, dump: Path | None, rank: int):
        self.trainer, self.rank = trainer, rank
        self.log_path = dump / FALCON_LOG if dump is not None else None
        self.events_path = dump / FALCON_EVENTS if dump is not None else None
        self._files = None if dump is None else (LineLog(self.log_path, "Falcon's decisions file"),
                                                 LineLog(self.events_path, "Falcon's events file"))
        self.events: list[dict] = []
        self.applied_names: set[str] = set()

    def record(self, decision: dict, rows: list[dict], step: int | None = None) -> None:
        """The step's decision dict (a ``falcon.jsonl`` row under ``step``, the step it observed;
        None: the trainer's current step) and its rows; an ``outcome`` row (iteration time before /
        after) is an applied strategy's only."""
        self.applied_names |= {r["name"] for r in rows if r["kind"] == "decision" and r["applied"]}
        rows = [r for r in rows if r["kind"] != "outcome" or r["name"] in self.applied_names]
        if self.rank == 0 and self._files is not None:
            decisions, events = self._files
            decisions.append([json.dumps({"step": self.trainer.step if step is None else step, **decision})])
            events.append([json.dumps(row) for row in rows])  # made at the first record, rows or not
            for row in rows:
                logger.info(f"[titan_ext] Falcon {_console(row)}")
        if rows:
            self.wandb(rows)

    def wandb(self, rows: list[dict]) -> None:
        """Rows → the ``falcon/events`` table, and per applied strategy its measured cost and, once
        measured, the iteration time before / after as scalars."""
        from titan_ext.titan.metrics import _wandb_loggers, log_tagged

        self.events.extend(rows)
        processor = getattr(self.trainer, "metrics_processor", None)
        for wb in _wandb_loggers(processor) if processor is not None else []:
            columns = sorted({k for r in self.events for k in r})
            log_tagged(wb, {"falcon/events": wb.wandb.Table(
                columns=columns, data=[[json.dumps(r.get(c)) for c in columns] for r in self.events]),
                **_scalars(rows)}, step=self.trainer.step)


def _scalars(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        if r["kind"] == "decision" and r["applied"] and r["measured_cost_s"] is not None:
            out[f"falcon/applied/{r['strategy']}/measured_cost_s"] = r["measured_cost_s"]
            out[f"falcon/applied/{r['strategy']}/estimated_cost_s"] = r["estimated_cost_s"]
        if r["kind"] == "outcome":
            out[f"falcon/outcome/{r['strategy']}/before_s"] = r["iteration_time_before_s"]
            out[f"falcon/outcome/{r['strategy']}/after_s"] = r["iteration_time_after_s"]
    return out
