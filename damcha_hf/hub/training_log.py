"""A `Trainer` log history, read for the model card: losses, evaluations, a loss-curve plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..safe_files.atomic_files import atomic_path

# Trainer log entries that are bookkeeping, not results.
NON_METRIC_KEYS = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step", "model_preparation_time")


@dataclass
class TrainingLog:
    """What a model card needs from a `Trainer`'s `state.log_history`."""

    train_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    eval_entries: list[dict] = field(default_factory=list)  # (step, epoch and) metrics without the `eval_` prefix
    summary: dict = field(default_factory=dict)  # the final `train_runtime` / `train_loss` entry
    peak_learning_rate: float | None = None
    last_step: int | None = None
    last_epoch: float | None = None

    @property
    def final_eval(self) -> dict[str, float]:
        if not self.eval_entries:
            return {}
        return {k: v for k, v in self.eval_entries[-1].items() if k not in ("step", "epoch")}


def load_log_history(log_history) -> list[dict]:
    """A `Trainer`'s `state.log_history` list, or the path of a `trainer_state.json` holding one."""
    if isinstance(log_history, (str, os.PathLike)):
        state = json.loads(Path(log_history).read_text())
        if "log_history" not in state:
            raise ValueError(f"log_history: {log_history} has no `log_history` field; pass a trainer_state.json.")
        return state["log_history"]
    if not isinstance(log_history, Sequence) or not all(isinstance(entry, Mapping) for entry in log_history):
        raise TypeError(
            "log_history must be `trainer.state.log_history` (a list of dicts) or a trainer_state.json path."
        )
    return [dict(entry) for entry in log_history]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def eval_metrics(entry: Mapping) -> dict[str, float]:
    """`{"eval_loss": 2.1, "eval_runtime": 3.0, ...}` -> `{"loss": 2.1}`: the metrics, without bookkeeping."""
    return {
        key.removeprefix("eval_"): float(value)
        for key, value in entry.items()
        if key.startswith("eval_") and is_number(value) and not key.removeprefix("eval_").endswith(NON_METRIC_KEYS)
    }


def parse_log_history(log_history) -> TrainingLog:
    """The losses, evaluations and summary of a log history. The evaluation entries of one step are merged into one
    (later values win): a `Trainer` logs the periodic evaluation at the last step and the `evaluate()` after training
    as two entries, and a recipe may log further metrics of the same evaluation as a third."""
    log = TrainingLog()
    evaluations: dict = {}  # step -> merged entry, in the order the steps were first logged
    for entry in load_log_history(log_history):
        step, epoch = entry.get("step"), entry.get("epoch")
        if is_number(step):
            log.last_step = max(int(step), log.last_step or 0)
        if is_number(epoch):
            log.last_epoch = max(float(epoch), log.last_epoch or 0.0)
        if "train_runtime" in entry or "train_loss" in entry:
            log.summary = entry
        elif is_number(entry.get("loss")) and is_number(step):
            log.train_losses.append((int(step), float(entry["loss"])))
        if is_number(entry.get("learning_rate")):
            log.peak_learning_rate = max(float(entry["learning_rate"]), log.peak_learning_rate or 0.0)
        metrics = eval_metrics(entry)
        if metrics:
            key = int(step) if is_number(step) else len(evaluations)  # an entry without a step stays on its own
            merged = evaluations.setdefault(key, {"step": int(step) if is_number(step) else None, "epoch": None})
            if is_number(epoch):
                merged["epoch"] = float(epoch)
            merged.update(metrics)
    log.eval_entries = list(evaluations.values())
    return log


def write_loss_curve(
    log_history, path: str | os.PathLike, *, baselines: Mapping[str, object] | None = None, name: str = "this model"
) -> bool:
    """Training (and validation) loss against step as a PNG, written atomically; False when nothing was logged.

    `baselines`: `{"MHA": log_history, ...}` of models trained alongside, drawn in the same axes (dashed), with
    `name` labelling this model's curves."""
    curves = []
    for label, history in [(name, log_history), *(baselines or {}).items()]:
        log = parse_log_history(history)
        validation = [
            (entry["step"], entry["loss"]) for entry in log.eval_entries if "loss" in entry and is_number(entry["step"])
        ]
        curves.append((label, log.train_losses, validation))
    if not curves[0][1] and not curves[0][2]:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6))
    for index, (label, train_losses, validation) in enumerate(curves):
        prefix = f"{label}: " if baselines else ""
        style = {"color": f"C{index}", "linestyle": "-" if index == 0 else "--"}
        if train_losses:
            axis.plot(*zip(*train_losses), label=f"{prefix}training loss", alpha=0.6, **style)
        if validation:
            axis.plot(*zip(*validation), marker="o", label=f"{prefix}validation loss", **style)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    try:
        with atomic_path(path) as temporary:
            figure.savefig(temporary, format="png", dpi=110)
    finally:
        plt.close(figure)
    return True
