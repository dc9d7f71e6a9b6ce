"""Falcon in a TorchTitan DP × PP job (Falcon §4–§5), one concern per module.

* :mod:`.job` — :class:`~.job.FalconJob`, the per-step flow: measure → observe → validate → decide
  → apply → record;
* :mod:`.dp` — the DP gradient sum the trainer owns (:class:`~.dp.DPSync`);
* :mod:`.emulate` — the emulated slow device / slow PP hop;
* :mod:`.measure` — the steps' observations (:class:`~.measure.StepClock`,
  :class:`~.measure.ObservationExchange` → :class:`~titan_ext.runtime.falcon.IterationObservation`),
  the ACF iteration time, validation;
* :mod:`.costs` — the strategies' costs measured in the job (Alg. 1's inputs);
* :mod:`.apply` — a decision → what changes in the job (:func:`~.apply.plan_changes`, a frozen
  :class:`~.apply.JobChanges`); the job applies it;
* :mod:`.s3` — S3 in memory; :mod:`.s4` — S4 (checkpoint, exit, relaunch);
* :mod:`.events` — ``falcon.jsonl``, ``falcon_events.jsonl``, console lines, W&B;
* :mod:`.files` — file names and emulation specs.

Modules are imported by name (this package imports nothing at import time: the S4 launcher,
``python -m titan_ext.titan.falcon.s4``, must start without TorchTitan's trainer).
"""
