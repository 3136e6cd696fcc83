"""A plain AdamW training loop with warm-up and cosine decay, for comparisons that need every model of a run to see
the same batches under the same schedule (the Trainer recipes shuffle and schedule on their own).

    loop = TrainingLoop(model, peak_lr=3e-3, total_steps=500)
    for step in range(500):
        loss = loop.step(batch_of(step))          # one optimiser step at the schedule's rate; the loss as a float

    curve = train(model, batch_of, steps=500, peak_lr=3e-3, log_every=25, label="MHA seed 0")

`total_steps` may be lowered while training (a time budget): the cosine then ends at the new total.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch


def warmup_cosine(step: int, total: int, peak: float, warmup: int | None = None, final_fraction: float = 0.1) -> float:
    """The learning rate of (0-based) `step`: linear warm-up over `warmup` steps (default 5% of `total`), then cosine
    decay to `final_fraction` of `peak` at `total`."""
    warmup = max(1, total // 20) if warmup is None else warmup
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def decays_unless_vector_or_embedding(name: str, parameter: torch.nn.Parameter) -> bool:
    """Weight decay on matrices only: not on biases, norms, or GPT-2's token and position embeddings."""
    return parameter.ndim >= 2 and "wte" not in name and "wpe" not in name


class TrainingLoop:
    """AdamW over every parameter of `model` (frozen ones never get a gradient, so they stay as they are), the
    learning rate set per step by `warmup_cosine`, gradients clipped to norm `clip`.

    `lr_multipliers` maps a module name to a factor on the learning rate of the parameters under it (the first name
    that a parameter's dotted path contains as a component wins), e.g. `{"cross_head_metric": 3.0}` trains DAMCHA's
    metric generators three times faster than the rest of the model."""

    def __init__(
        self,
        model: torch.nn.Module,
        peak_lr: float,
        total_steps: int,
        *,
        warmup: int | None = None,
        final_fraction: float = 0.1,
        weight_decay: float = 0.05,
        decays: Callable[[str, torch.nn.Parameter], bool] = decays_unless_vector_or_embedding,
        betas: tuple[float, float] = (0.9, 0.98),
        clip: float = 1.0,
        lr_multipliers: dict[str, float] | None = None,
    ):
        lr_multipliers = lr_multipliers or {}
        for module_name, factor in lr_multipliers.items():
            if not factor > 0:
                raise ValueError(f"lr_multipliers[{module_name!r}] must be positive, got {factor}.")

        def scale(name: str) -> float:
            components = name.split(".")
            return next((factor for module, factor in lr_multipliers.items() if module in components), 1.0)

        groups = {}
        for name, parameter in model.named_parameters():
            decay = weight_decay if decays(name, parameter) else 0.0
            group = groups.setdefault(
                (decay, scale(name)), {"params": [], "weight_decay": decay, "lr_scale": scale(name)}
            )
            group["params"].append(parameter)
        self.optimizer = torch.optim.AdamW(list(groups.values()), lr=peak_lr, betas=betas)
        self.model, self.peak_lr, self.total_steps, self.warmup = model, peak_lr, total_steps, warmup
        self.final_fraction, self.clip, self.steps_done = final_fraction, clip, 0

    def learning_rate(self) -> float:
        return warmup_cosine(self.steps_done, self.total_steps, self.peak_lr, self.warmup, self.final_fraction)

    def step(self, batch: dict, label: str = "training") -> float:
        """One optimiser step on `batch` (the model's keyword arguments, labels included); returns the loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate() * group["lr_scale"]
        self.model.train()
        loss = self.model(**batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"{label}: loss became {loss.item()} at step {self.steps_done}; lower the learning rate."
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.steps_done += 1
        return loss.item()


PROGRESS_SECONDS = 60.0


def progress_bar_options(stream=None) -> dict:
    """tqdm options for a training loop's bar on `stream` (tqdm's, standard error, by default): on a terminal the
    live bar; in a file or a pipe (a log), a redraw at most every PROGRESS_SECONDS, where the default ten a second
    would leave thousands of lines."""
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return {}
    return {"mininterval": PROGRESS_SECONDS, "maxinterval": PROGRESS_SECONDS}


def train(
    model: torch.nn.Module,
    next_batch: Callable[[int], dict],
    steps: int,
    peak_lr: float,
    log_every: int,
    label: str,
    **loop_options,
) -> list[tuple[int, float]]:
    """`steps` steps of a `TrainingLoop` on `next_batch(step)`; returns the loss curve [(step, mean loss over the
    last `log_every` steps)]. A progress line at most every `PROGRESS_SECONDS`, so that a long run shows it is alive."""
    loop = TrainingLoop(model, peak_lr, steps, **loop_options)
    curve, window = [], []
    started = reported = time.time()
    for step in range(steps):
        window.append(loop.step(next_batch(step), label))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append((step + 1, sum(window) / len(window)))
            window = []
            now = time.time()
            if now - reported >= PROGRESS_SECONDS and step + 1 < steps:
                reported, per_step = now, (now - started) / (step + 1)
                print(f"  {label}: step {step + 1}/{steps}, train loss {curve[-1][1]:.4f}, {1000 * per_step:.0f} "
                      f"ms/step, about {per_step * (steps - step - 1) / 60:.0f} min left", flush=True)  # fmt: skip
    print(f"  {label}: {steps} steps in {time.time() - started:.0f}s, final train loss {curve[-1][1]:.4f}", flush=True)
    return curve
