"""Hub-ready DAMCHA checkpoints: model cards, one-call checkpoint folders, and pushing them to the Hub.

    from damcha_hf.hub import save_hub_checkpoint, push_checkpoint

    # At the end of training (e.g. in a recipe):
    save_hub_checkpoint(
        model, "runs/my-damcha/hub",
        tokenizer_or_processor=tokenizer,          # or an image processor; saved next to the weights
        log_history=trainer.state.log_history,     # training details, results and a loss curve in the card
        base_model="openai-community/gpt2",        # when converted from a pretrained MHA model
        datasets=["wikitext"],
    )
    push_checkpoint("runs/my-damcha/hub", "your-name/my-damcha", private=True)   # or: damcha-hf push ...

`save_hub_checkpoint` writes, atomically (a temporary folder beside `folder`, then a rename), the safetensors weights,
`config.json` with an `auto_map` for every Auto class of the family, the model code (remote code: it loads with
`trust_remote_code=True` where damcha_hf is not installed), the tokenizer or image processor, a `README.md` model
card, a loss curve and a heatmap of the learned cross-head metric. `push_checkpoint` uploads exactly those files,
never optimizer or trainer state.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData

from .families import DamchaFamily, family_for_model_type, family_of
from .metric_map import MetricMap, is_vision_model, write_metric_map
from .safe_files import (
    CARD_FILE,
    CONFIG_FILES,
    LOSS_CURVE_FILE,
    METRIC_HEATMAP_FILE,
    MODEL_TYPE_PREFIX,
    PREPROCESSOR_FILES,
    apply_umask,
    atomic_path,
    atomic_write,
    check_checkpoint_folder,
    make_staging_folder,
    public_dataset_name,
)

# Stands for the repository id in a card written before the repository is known; `push_checkpoint` fills it in.
REPO_PLACEHOLDER = "your-name/your-damcha-model"

PAPER_TITLE = "Data-Adaptive Mahalanobis Metric Learning for Cross-Head Attention in Transformers"
CITATION_BIBTEX = f"""@inproceedings{{damcha2026,
  title     = {{{PAPER_TITLE}}},
  booktitle = {{Advances in Neural Information Processing Systems}},
  year      = {{2026}},
  note      = {{Author list not recorded here: take it from the paper}}
}}"""

TEXT_SUFFIXES = (".json", ".md", ".py", ".txt", ".jinja")
# Trainer log entries that are bookkeeping, not results.
NON_METRIC_KEYS = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step", "model_preparation_time")


class HubPushError(RuntimeError):
    """Pushing cannot start: offline, no token, or a folder that is not a clean Hub checkpoint."""


# --------------------------------------------------------------------------------------------------------- the model


VARIANT_DESCRIPTIONS = {
    "talking_heads": "talking-heads attention (static H x H mixing of the attention logits and weights)",
    "dcmha": "DCMHA (dynamically composable multi-head attention: input-dependent mixing of the score maps)",
    "none": "plain multi-head attention",
}


def model_family(model) -> DamchaFamily:
    """The architecture's declaration (`damcha_hf.families`), from the config's `model_type` (`damcha_llama`, ...)."""
    return family_of(model)


def cross_head_variant(model) -> str:
    """`"damcha"`, or the baseline attention the model runs instead (`talking_heads`, `dcmha`, `none`)."""
    # Every DAMCHA config has the field; a config without it is a stock transformers model: plain attention.
    return getattr(model.config, "cross_head_variant", "none")


def pipeline_tag_and_auto_class(model) -> tuple[str, str]:
    """The card's pipeline tag and loading Auto class: those its family declares for this head (matched by class name,
    since remote-code classes live in other modules); a base model is a feature extractor."""
    name = type(model).__name__
    for head in model_family(model).heads:
        if head.model_class.__name__ == name and head.pipeline_tag:
            return head.pipeline_tag, head.auto_class
    if is_vision_model(model):
        return "image-feature-extraction", "AutoModel"
    return "feature-extraction", "AutoModel"


def generator_share(model) -> tuple[int, int]:
    """(cross-head parameters: DAMCHA's metric generator or a baseline's head mixing, all parameters)."""
    total = sum(parameter.numel() for parameter in model.parameters())
    generator = sum(
        p.numel() for name, p in model.named_parameters() if "cross_head_metric" in name or "cross_head_mixing" in name
    )
    return generator, total


# ------------------------------------------------------------------------------------------------- the log history


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
    log = TrainingLog()
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
            log.eval_entries.append({"step": step, "epoch": epoch, **metrics})
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


# ------------------------------------------------------------------------------------------------------ the card


def format_number(value) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(format_number(cell) if cell is not None else "" for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def resolve_eval_results(model, log: TrainingLog | None, eval_results: Mapping[str, float] | None) -> dict[str, float]:
    """Given results win; else the last evaluation of the log. A causal LM's loss also gives its perplexity."""
    if eval_results is not None:
        results = {key.removeprefix("eval_"): float(value) for key, value in eval_results.items() if is_number(value)}
    else:
        results = dict(log.final_eval) if log else {}
    pipeline_tag, _ = pipeline_tag_and_auto_class(model)
    named = any("perplexity" in name for name in results)  # e.g. a per-byte perplexity given by the caller
    if pipeline_tag == "text-generation" and "loss" in results and not named and results["loss"] < 50:
        results["perplexity"] = math.exp(results["loss"])
    return results


def check_hub_id(argument: str, value: str) -> None:
    """Card metadata must name Hub ids: a local path would leak the machine's layout into a public file."""
    if os.path.isabs(value) or value.startswith((".", "~")) or os.path.isdir(value):
        raise ValueError(
            f"{argument}={value!r} looks like a local path; pass the Hub id it came from, e.g. 'openai-community/gpt2'."
        )


def build_model_card(
    model,
    *,
    log_history=None,
    base_model: str | None = None,
    datasets: str | Sequence[str] | None = None,
    license: str = "apache-2.0",
    eval_results: Mapping[str, float] | None = None,
    images: Mapping[str, str] | None = None,
    metric_map: MetricMap | None = None,
    model_name: str | None = None,
    repo_id: str = REPO_PLACEHOLDER,
    has_preprocessor: bool = True,
    log_source: str = "the `Trainer` log history",
    comparison: Mapping[str, Mapping[str, float]] | None = None,
    notes: Sequence[str] = (),
) -> ModelCard:
    """A Hub model card for a DAMCHA model.

    Args:
        log_history: a `Trainer`'s `state.log_history` (or a trainer_state.json path): training details, a results
            table and, unless `eval_results` is given, the evaluation results.
        base_model: Hub id of the MHA checkpoint this model was converted from.
        datasets: Hub ids of the training data; the first also names the evaluation data in `model-index`. A local
            path is reduced to its base name (see `damcha_hf.safe_files.public_dataset_name`).
        eval_results: `{"loss": 2.3, "accuracy": 0.81}` (an `eval_` prefix is dropped); overrides the log's.
        images: relative paths of images written next to the card: `{"loss_curve": ..., "metric_heatmap": ...}`.
            `save_hub_checkpoint` writes both and fills this in.
        metric_map: the `MetricMap` behind the heatmap, for the per-layer off-diagonal mass table.
        repo_id: used in the loading snippets; `push_checkpoint` replaces the placeholder with the real id.
        log_source: what `log_history` is, for the training section (e.g. "the demo's training loop").
        comparison: `{"MHA baseline": {"bits_per_byte": 2.1}, ...}`: models trained the same way, shown in a table
            beside this model's `eval_results` (never as this model's metrics).
        notes: sentences added to the limitations.
    """
    images = dict(images or {})
    for kind, relative in images.items():
        if os.path.isabs(relative):
            raise ValueError(f"images[{kind!r}]={relative!r}: give the path relative to the card's folder.")
    if base_model is not None:
        check_hub_id("base_model", base_model)
    datasets = [datasets] if isinstance(datasets, str) else list(datasets or [])
    # A dataset given as a local path is named by its base name (or left out): the card is meant to be published.
    datasets = [name for name in map(public_dataset_name, datasets) if name]
    config = model.config
    family = model_family(model).model_type
    pipeline_tag, auto_class = pipeline_tag_and_auto_class(model)
    log = parse_log_history(log_history) if log_history is not None else None
    results = resolve_eval_results(model, log, eval_results)
    model_name = model_name or (repo_id.split("/")[-1] if repo_id != REPO_PLACEHOLDER else f"damcha-{family}")

    eval_dataset = datasets[0] if datasets else "custom"
    card_data = ModelCardData(
        library_name="transformers",
        license=license,
        pipeline_tag=pipeline_tag,
        tags=["damcha", "cross-head-attention", family, "custom_code"],
        base_model=base_model,
        datasets=datasets or None,
        model_name=model_name,
        eval_results=[
            EvalResult(
                task_type=pipeline_tag,
                dataset_type=eval_dataset,
                dataset_name=eval_dataset if datasets else "held-out evaluation data",
                metric_type=name,
                metric_name=name,
                metric_value=round(value, 6),
            )
            for name, value in results.items()
        ]
        or None,
    )

    generator, total = generator_share(model)
    family_name, variant = model_family(model).display_name, cross_head_variant(model)
    if variant == "damcha":
        introduction = (
            f"A {family_name} model ({type(model).__name__}) with **DAMCHA** attention, data-adaptive cross-head "
            f"metric attention from *{PAPER_TITLE}* (NeurIPS 2026): each head scores its queries against a mixture "
            "of every head's keys, `K~_i = sum_j C_ij(x) K_j`, with the cross-head matrix `C = I + G(x)` produced "
            "from the layer's input by a small metric-generator MLP. Everything else is the standard "
            f"{family_name} architecture."
        )
        settings = [
            ("metric_context", f"`{config.metric_context}`"),
            ("metric_mask", f"`{config.metric_mask}`"),
            ("metric_sharing", f"`{config.metric_sharing}`"),
            ("metric_hidden_size", config.metric_hidden_size),
        ]
    else:
        introduction = (
            f"A {family_name} model ({type(model).__name__}) trained as a **baseline** for DAMCHA (*{PAPER_TITLE}*, "
            f"NeurIPS 2026): its attention is {VARIANT_DESCRIPTIONS.get(variant, variant)} "
            f'(`cross_head_variant="{variant}"`), run by the same damcha-hf code so that comparisons differ only '
            "in attention."
        )
        settings = [("cross_head_variant", f"`{variant}`")]
    sections = [
        f"# {model_name}",
        (
            introduction
            + (
                f"\n\nConverted from [`{base_model}`](https://huggingface.co/{base_model}): every pretrained weight "
                "was kept and the new cross-head parameters started at the identity (for DAMCHA: the metric "
                "generator at zero, `C = I`), so before fine-tuning the model computed exactly the original "
                "multi-head attention."
                if base_model
                else ""
            )
        ),
        "## DAMCHA settings\n\n"
        + markdown_table(
            ("setting", "value"),
            settings
            + [
                (
                    "layers x heads x width",
                    f"{config.num_hidden_layers} x {config.num_attention_heads} x {config.hidden_size}",
                ),
                ("parameters", total),
                (
                    "metric-generator parameters" if variant == "damcha" else "cross-head mixing parameters",
                    f"{generator:,} ({100 * generator / total:.3f}% of the model)",
                ),
            ],
        ),
        loading_section(auto_class, repo_id, family, has_preprocessor),
    ]
    if "metric_heatmap" in images or metric_map is not None:
        sections.append(metric_section(images.get("metric_heatmap"), metric_map))
    sections.append(training_section(log, images.get("loss_curve"), log_source))
    sections.append(evaluation_section(results, eval_dataset if datasets else None, from_log=eval_results is None))
    if comparison:
        sections.append(comparison_section(model_name, results, comparison))
    sections.append(LIMITATIONS + "".join(f"\n- {note}" for note in notes))
    sections.append(
        "## Citation\n\nThe authors of the DAMCHA paper are not recorded in this card (we did not have the author "
        "list when it was written); please complete the entry from the paper before citing it.\n\n"
        f"```bibtex\n{CITATION_BIBTEX}\n```"
    )
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)


def loading_section(auto_class: str, repo_id: str, family: str, has_preprocessor: bool) -> str:
    preprocessor_class = "AutoImageProcessor" if family_for_model_type(family).vision else "AutoTokenizer"
    imports = f"{auto_class}, {preprocessor_class}" if has_preprocessor else auto_class

    def snippet(plugin: bool) -> str:
        lines = ["import damcha_hf  # registers the DAMCHA classes with the Auto classes"] if plugin else []
        suffix = "" if plugin else ", trust_remote_code=True"
        lines += [
            f"from transformers import {imports}",
            "",
            f'model = {auto_class}.from_pretrained("{repo_id}"{suffix})',
        ]
        if has_preprocessor:
            # Without the plugin, the tokenizer / image processor also needs trust_remote_code: to find its class,
            # transformers may read config.json, and an unknown model_type there without the flag stops at an
            # interactive "Do you wish to run the custom code? [y/N]" prompt (a hang in a notebook or a script).
            lines.append(f'preprocessor = {preprocessor_class}.from_pretrained("{repo_id}"{suffix})')
        return "```python\n" + "\n".join(lines) + "\n```"

    return (
        "## How to load\n\nWith the `damcha-hf` plugin installed (it is not on PyPI: in a clone of its repository, "
        "`pip install -e .`):\n\n"
        + snippet(plugin=True)
        + "\n\nWithout the plugin: the repository carries the model code (`configuration_damcha_*.py`, "
        "`modeling_damcha_*.py`, `damcha_attention.py` and the files they import; they import only torch and "
        "transformers), which "
        "transformers runs when you allow remote code. Read it first: it executes on your machine.\n\n"
        + snippet(plugin=False)
        + "\n\n`config.json` maps every Auto class of the family (`auto_map`), so the same checkpoint also loads "
        "with `AutoModel` and the other task heads."
    )


def metric_section(image: str | None, metric_map: MetricMap | None) -> str:
    text = (
        "## Learned cross-head metric\n\nThe cross-head matrix `C` of each layer, averaged over the tokens of a few "
        "sample inputs (`damcha-hf inspect` redraws it). `C = I` is plain multi-head attention; off-diagonal "
        "entries are how much head `i` scores against head `j`'s keys."
    )
    if image:
        text += f"\n\n![Mean cross-head matrix C per layer]({image})"
    if metric_map is not None:
        text += "\n\nOff-diagonal mass `sum_{i!=j} |C_ij| / sum_ij |C_ij|` of the mean matrix:\n\n" + markdown_table(
            ("layer", "off-diagonal mass"),
            [(layer, f"{mass:.4f}") for layer, mass in enumerate(metric_map.offdiagonal_mass)],
        )
    return text


MAX_RESULT_ROWS = 25


def training_section(log: TrainingLog | None, loss_curve: str | None, source: str = "the `Trainer` log history") -> str:
    if log is None:
        return "## Training details\n\nNo training log was recorded with this checkpoint."
    facts = []
    if log.last_step is not None:
        facts.append(f"- steps: {log.last_step:,}")
    if log.last_epoch is not None:
        facts.append(f"- epochs: {log.last_epoch:.3g}")
    if log.peak_learning_rate is not None:
        facts.append(f"- peak learning rate: {log.peak_learning_rate:.3g}")
    if log.train_losses:
        facts.append(f"- final logged training loss: {log.train_losses[-1][1]:.4f}")
    if is_number(log.summary.get("train_loss")):
        facts.append(f"- mean training loss: {log.summary['train_loss']:.4f}")
    if is_number(log.summary.get("train_runtime")):
        facts.append(f"- training time: {log.summary['train_runtime'] / 60:.1f} min")
    text = f"## Training details\n\nFrom {source}:\n\n" + "\n".join(facts)
    if loss_curve:
        text += f"\n\n![Training and validation loss]({loss_curve})"
    rows = results_rows(log)
    if rows:
        header, body = rows
        text += "\n\n### Training results\n\n" + markdown_table(header, body)
    return text


def results_rows(log: TrainingLog) -> tuple[list[str], list[list]] | None:
    """One row per evaluation (else per logged training loss): step, epoch, training loss, metrics."""
    train_by_step = dict(log.train_losses)
    if log.eval_entries:
        metric_names = list(
            dict.fromkeys(name for entry in log.eval_entries for name in entry if name not in ("step", "epoch"))
        )
        header = ["step", "epoch", "training loss"] + [f"validation {name}" for name in metric_names]
        body = []
        for entry in log.eval_entries:
            step = entry["step"]
            earlier = [loss for logged_step, loss in log.train_losses if step is None or logged_step <= step]
            training_loss = train_by_step.get(step, earlier[-1] if earlier else None)
            body.append([step, entry["epoch"], training_loss] + [entry.get(name) for name in metric_names])
    elif log.train_losses:
        header = ["step", "training loss"]
        body = [list(point) for point in log.train_losses]
    else:
        return None
    if len(body) > MAX_RESULT_ROWS:  # evenly thinned, keeping the last row
        stride = math.ceil(len(body) / MAX_RESULT_ROWS)
        body = body[::-1][::stride][::-1]
    return header, body


def evaluation_section(results: Mapping[str, float], dataset: str | None, from_log: bool) -> str:
    if not results:
        return "## Evaluation results\n\nNo evaluation results were recorded with this checkpoint."
    source = "the last evaluation in the training log" if from_log else "the evaluation run given with this card"
    on = f" on `{dataset}`" if dataset else ""
    return f"## Evaluation results\n\nFrom {source}{on}:\n\n" + markdown_table(
        ("metric", "value"), [(name, f"{value:.4f}") for name, value in results.items()]
    )


def comparison_section(
    model_name: str, results: Mapping[str, float], comparison: Mapping[str, Mapping[str, float]]
) -> str:
    """This model's results beside those of models trained the same way (e.g. the MHA baseline)."""
    names = list(dict.fromkeys(name for row in [results, *comparison.values()] for name in row))
    rows = [[f"{model_name} (this model)"] + [format_metric(results.get(name)) for name in names]]
    rows += [[label] + [format_metric(row.get(name)) for name in names] for label, row in comparison.items()]
    return (
        "## Comparison\n\nThe same data, steps, batches and starting weights; only the attention differs:\n\n"
        + markdown_table(["model", *names], rows)
    )


def format_metric(value) -> str:
    return "" if value is None else f"{value:.4f}"


LIMITATIONS = """## Limitations

- DAMCHA's published gains are small on several benchmarks and reported as single runs; the damcha-hf authors'
  small-scale prototype found effects within the seed spread. Compare against a multi-head-attention baseline
  trained the same way before relying on an improvement.
- `C` is neither symmetric nor positive definite: the score is a learned bilinear form, not a true Mahalanobis
  metric (the paper says so too).
- The model code extends transformers' GPT-2/ViT internals and was tested with the releases damcha-hf pins
  (transformers 5.23 and 5.24); other releases may change those internals.
- The model inherits the biases and failure modes of its training data and of any base checkpoint."""


# -------------------------------------------------------------------------------------------- the checkpoint folder


def save_hub_checkpoint(
    model,
    folder: str | os.PathLike,
    *,
    tokenizer_or_processor=None,
    log_history=None,
    base_model: str | None = None,
    datasets: str | Sequence[str] | None = None,
    heatmap_inputs=None,
    metric_heatmap: bool = True,
    license: str = "apache-2.0",
    eval_results: Mapping[str, float] | None = None,
    model_name: str | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, str | bytes] | None = None,
    baseline_log_histories: Mapping[str, object] | None = None,
    **card_fields,
) -> Path:
    """Write a complete Hub checkpoint of `model` into `folder`, atomically, and return `folder`.

    Contents: `model.safetensors` (or shards), `config.json` (with `auto_map`), `generation_config.json` for
    generative models, the model code, the tokenizer or image processor, `README.md` (see `build_model_card`),
    `loss_curve.png` (when `log_history` logged a loss) and `metric_heatmap.png` (unless `metric_heatmap=False`).

    Args:
        model: a DAMCHA `PreTrainedModel` (merge LoRA adapters first: `model.merge_and_unload()`).
        tokenizer_or_processor: saved with `save_pretrained`; a tokenizer also tokenises the heatmap text.
        log_history, base_model, datasets, license, eval_results, model_name: see `build_model_card`.
        heatmap_inputs: inputs for the metric heatmap (`damcha_hf.metric_map.compute_metric_map` accepts a tensor,
            a dict of model inputs, a list of them, or texts); None uses a built-in sample.
        overwrite: replace an existing `folder` that holds an earlier checkpoint of this plugin (a `damcha_*`
            config.json and only files a save writes). A folder holding anything else (a Trainer `output_dir`, your
            own files), the current folder, its parents and the home folder are never replaced: `UnsafeOutputError`
            (an `OSError`) is raised before anything is written. Use a subfolder such as `output_dir/"hub"`.
        extra_files: `{file name: text or bytes}` written beside the checkpoint in the same atomic step (e.g. a
            run's results); they count as files the save writes when the folder is replaced later.
        baseline_log_histories: `{"MHA": log_history}` of models trained alongside: drawn in the loss curve too.
        card_fields: `log_source`, `comparison`, `notes` of `build_model_card`.

    Everything is written into a temporary folder beside `folder` and renamed into place, so `folder` is never
    left half-written.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"save_hub_checkpoint needs a transformers PreTrainedModel, got {type(model).__name__}; unwrap it first "
            "(`accelerator.unwrap_model(model)`, or `model.merge_and_unload()` for a PEFT model)."
        )
    extra_files = dict(extra_files or {})
    for name in extra_files:
        if name != os.path.basename(name) or name in ("", ".", "..") or name in CONFIG_FILES:
            raise ValueError(f"extra_files: {name!r} must be a plain file name, not a path or a config file.")
    folder = check_checkpoint_folder(
        folder, argument="save_hub_checkpoint folder", replace=overwrite, also_written=extra_files
    )
    staging = make_staging_folder(folder)
    try:
        model.save_pretrained(staging)
        config, changed = completed_config(staging)
        if changed:
            atomic_write(staging / "config.json", config_json_bytes(config))
        if tokenizer_or_processor is not None:
            tokenizer_or_processor.save_pretrained(staging)
        images = {}
        if log_history is not None and write_loss_curve(
            log_history, staging / LOSS_CURVE_FILE, baselines=baseline_log_histories, name=model_name or "this model"
        ):
            images["loss_curve"] = LOSS_CURVE_FILE
        metric_map = None
        if metric_heatmap and cross_head_variant(model) == "damcha":  # the baselines have no cross-head metric C
            tokenizer = (
                None if is_vision_model(model) or not callable(tokenizer_or_processor) else tokenizer_or_processor
            )
            metric_map = write_metric_map(model, staging / METRIC_HEATMAP_FILE, heatmap_inputs, tokenizer=tokenizer)
            images["metric_heatmap"] = METRIC_HEATMAP_FILE
        card = build_model_card(
            model,
            log_history=log_history,
            base_model=base_model,
            datasets=datasets,
            license=license,
            eval_results=eval_results,
            images=images,
            metric_map=metric_map,
            model_name=model_name,
            has_preprocessor=tokenizer_or_processor is not None,
            **card_fields,
        )
        atomic_write(staging / CARD_FILE, str(card))
        for name, content in extra_files.items():
            atomic_write(staging / name, content)
        check_no_local_paths(staging, upload_plan(staging).values(), extra=[folder])
        apply_umask(staging)
        replace_folder(staging, folder, overwrite=overwrite, also_written=extra_files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def replace_folder(new: Path, target: Path, *, overwrite: bool, also_written: Iterable[str] = ()) -> None:
    """Rename `new` to `target`. An existing `target` is checked again (it may have changed during the save: only an
    earlier checkpoint of this plugin is replaced), moved aside, and deleted once `new` is in place."""
    if target.exists():
        check_checkpoint_folder(
            target, argument="save_hub_checkpoint folder", replace=overwrite, also_written=also_written
        )
    if not target.exists() or not any(target.iterdir()):
        if target.is_dir():
            target.rmdir()
        os.replace(new, target)
        return
    old = _aside_name(target)
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _aside_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.old-{os.getpid()}-{os.urandom(4).hex()}")


# ---------------------------------------------------------------------------------------------------------- pushing


def auto_map_module(key: str, reference) -> str | None:
    """The module file an `auto_map` reference names (`"modeling_damcha_gpt2.DamchaGPT2Model"` ->
    `"modeling_damcha_gpt2"`); None for code in another Hub repository (`"owner/repo--module.Class"`), which is
    not a file of this folder. Anything but a plain module name (an absolute path, `..`, a folder) is refused: a push
    must never read a file outside the checkpoint folder."""
    if not isinstance(reference, str):
        return None  # e.g. a tokenizer's [slow, fast] pair: not code of this folder
    if "--" in reference:
        return None
    module, _, class_name = reference.rpartition(".")
    if not module.isidentifier() or not class_name.isidentifier():
        raise HubPushError(
            f"config.json's auto_map[{key!r}] = {reference!r} is not `module.Class` with a plain module name of a "
            "file in the checkpoint folder; re-save the model with `save_pretrained` after `import damcha_hf`, "
            "which writes a clean auto_map."
        )
    return module


def checked_file(folder: Path, name: str) -> Path | None:
    """`folder/name` when it is a regular file inside `folder` (a symbolic link may point only at another file of the
    folder); None when it does not exist. Raises `HubPushError` for a link leaving the folder or a non-file."""
    path = folder / name
    if not path.exists() and not path.is_symlink():
        return None
    resolved = path.resolve()
    if path.is_symlink() and resolved.parent != folder.resolve():
        raise HubPushError(
            f"{name} in {folder} is a symbolic link to {resolved}, outside the checkpoint folder; replace it with the "
            "file itself (a push uploads only files inside the folder)."
        )
    if not resolved.is_file():
        raise HubPushError(f"{name} in {folder} is not a regular file; remove it or replace it with the file.")
    return path


def auto_map_code_files(folder: Path, auto_map: Mapping) -> list[str]:
    """The Python files `auto_map` names, plus everything they import with single-dot relative imports."""
    pending = [module for key, reference in auto_map.items() if (module := auto_map_module(key, reference))]
    seen: list[str] = []
    while pending:
        module = pending.pop()
        name = f"{module}.py"
        if name in seen:
            continue
        path = checked_file(folder, name)
        if path is None:
            raise HubPushError(
                f"{folder}: config.json's auto_map needs {name}, which is missing; re-save the model with "
                "`save_pretrained` (or `damcha_hf.hub.save_hub_checkpoint`) after `import damcha_hf`."
            )
        seen.append(name)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                if not node.module.isidentifier():  # `from .pkg.mod import x`: not a file of this folder
                    raise HubPushError(f"{name} imports `.{node.module}`, which is not a file of {folder}.")
                pending.append(node.module)
    return sorted(seen)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")


def card_images(card_text: str) -> list[str]:
    """Image links of the card that name a file of its folder (`![alt](loss_curve.png)`); URLs, paths and other
    links are not followed."""
    names = []
    for link in IMAGE_LINK.findall(card_text):
        plain = link == os.path.basename(link) and "\\" not in link and ":" not in link and link not in (".", "..")
        if plain and link.lower().endswith(IMAGE_SUFFIXES):
            names.append(link)
    return names


IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def family_auto_map(model_type: str) -> dict[str, str]:
    """Every Auto class of a DAMCHA family (from `registration.AUTO_CLASS_TABLE`), as `auto_map` references."""
    from .registration import AUTO_CLASS_TABLE

    def reference(cls) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    for config_class, model_classes in AUTO_CLASS_TABLE:
        if config_class.model_type == model_type:
            auto_map = {"AutoConfig": reference(config_class)}
            auto_map.update({auto_class.__name__: reference(model_class) for auto_class, model_class in model_classes})
            return auto_map
    return {}


def completed_config(folder: Path) -> tuple[dict, bool]:
    """`config.json` with `auto_map` listing exactly the model family's classes (a checkpoint of one head then loads
    with every Auto class under remote code, whichever class saved it; entries naming other code, e.g. carried over
    from a downloaded checkpoint, are dropped); and whether that changed it."""
    config = json.loads((folder / "config.json").read_text())
    auto_map = config.get("auto_map") or {}
    family = family_auto_map(config.get("model_type", ""))
    completed = (family or auto_map) if auto_map else auto_map
    changed = completed != auto_map
    config["auto_map"] = completed
    return config, changed


def config_json_bytes(config: dict) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")  # as transformers writes it


def upload_plan(folder: str | os.PathLike) -> dict[str, Path]:
    """`{path in repo: local file}` of what a push uploads: weights, config, code, preprocessor, card, images.

    Raises `HubPushError` when the folder is not a complete safetensors checkpoint with its code.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(
            f"{folder} is not a folder: pass a folder written by save_pretrained or save_hub_checkpoint."
        )
    if checked_file(folder, "config.json") is None:
        raise HubPushError(
            f"{folder} has no config.json: pass a folder written by save_pretrained or save_hub_checkpoint."
        )
    weights = sorted(path.name for path in folder.glob("*.safetensors") if checked_file(folder, path.name))
    if not weights:
        legacy = [path.name for path in folder.glob("*.bin") if path.name.startswith("pytorch_model")]
        hint = f" (found {', '.join(legacy)}: pickled weights are not uploaded)" if legacy else ""
        raise HubPushError(
            f"{folder} has no safetensors weights{hint}; re-save with `model.save_pretrained(folder)`, which writes "
            "model.safetensors."
        )
    saved_auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    for key, reference in saved_auto_map.items():  # refuse absolute or `..` references, even those the push drops
        auto_map_module(key, reference)
    config, _ = completed_config(folder)
    # A stock checkpoint (an MHA baseline trained by a recipe) loads with transformers alone; a DAMCHA one needs its code.
    if not config.get("auto_map") and str(config.get("model_type", "")).startswith(MODEL_TYPE_PREFIX):
        raise HubPushError(
            f"{folder}/config.json has no auto_map, so the checkpoint would not load without damcha-hf; re-save it "
            "after `import damcha_hf` (which registers the classes for remote code)."
        )
    names = list(CONFIG_FILES) + weights + [path.name for path in folder.glob("*.safetensors.index.json")]
    names += auto_map_code_files(folder, config.get("auto_map") or {}) + list(PREPROCESSOR_FILES)
    card = checked_file(folder, CARD_FILE)
    if card is not None:
        names += [CARD_FILE, *card_images(card.read_text(encoding="utf-8"))]
    plan = {}
    for name in dict.fromkeys(names):
        path = checked_file(folder, name)
        if path is not None:
            plan[name] = path
    return plan


def local_path_markers(folder: Path, extra: Iterable[Path] = ()) -> list[str]:
    """Absolute paths that must not appear in a public file: the folder, its parent, the home folder."""
    markers = set()
    for path in [folder, *extra]:
        for variant in (Path(path).absolute(), Path(path).resolve()):
            markers.update({str(variant), str(variant.parent)})
    home = str(Path.home())
    if len(home) > 1:
        markers.add(home)
    return sorted(marker for marker in markers if len(marker) > 1)


def check_no_local_paths(folder: Path, files: Iterable[Path], extra: Iterable[Path] = ()) -> None:
    markers = local_path_markers(folder, extra)
    for path in files:
        if path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for marker in markers:
            if marker in text:
                raise HubPushError(
                    f"{path.name} contains the local path {marker!r}; remove it before sharing the file."
                )


def check_can_push(token: str | None) -> str:
    """Fail before any network call when offline or without a token; returns the token to use."""
    from huggingface_hub import constants, get_token

    flags = [
        name
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
    ]
    if flags or constants.HF_HUB_OFFLINE:
        raise HubPushError(
            f"cannot push: Hugging Face Hub offline mode is on ({', '.join(flags) or 'HF_HUB_OFFLINE'}=1). "
            "Unset it (e.g. `HF_HUB_OFFLINE=0 damcha-hf push ...`) on a machine with network access."
        )
    token = token or get_token()
    if not token:
        raise HubPushError(
            "cannot push: no Hugging Face token. Pass --token (token=...), set HF_TOKEN, or run `hf auth login`; "
            "the token needs write access."
        )
    return token


def push_checkpoint(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload DAMCHA checkpoint",
) -> str:
    """Upload a checkpoint folder to the Hub model repository `repo_id` (created if needed); returns the commit URL.

    Uploads only the safetensors weights, config files (`config.json` with its `auto_map` completed to every Auto
    class of the family), the model code named by `auto_map`, tokenizer or image processor files, `README.md` (with the repository id filled into its loading snippets) and the images it shows:
    never optimizer, scheduler, RNG or trainer state. Raises `HubPushError`, before any network call, when offline
    (`HF_HUB_OFFLINE=1`), without a token, or when a file would leak a local path.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    token = check_can_push(token)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubPushError(f"repo_id {repo_id!r} is not a valid Hub id ('name' or 'namespace/name'): {error}") from None
    folder = Path(folder)
    plan = upload_plan(folder)
    check_no_local_paths(folder, plan.values())
    operations = []
    for path_in_repo, path in plan.items():
        content = str(path)
        if path_in_repo == CARD_FILE:
            content = path.read_text(encoding="utf-8").replace(REPO_PLACEHOLDER, repo_id).encode("utf-8")
        elif path_in_repo == "config.json":
            config, changed = completed_config(folder)
            content = config_json_bytes(config) if changed else content
        operations.append(CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=content))
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.create_commit(
            repo_id, operations=operations, commit_message=commit_message, revision=revision, repo_type="model"
        )
    except Exception as error:  # network, authentication, permission: one line, without the token
        message = " ".join(str(error).split()).replace(token, "<token>") or type(error).__name__
        raise HubPushError(
            f"pushing to {repo_id} failed ({type(error).__name__}): {message[:300]}. Check the network, that the "
            "token has write access to the repository, and try again."
        ) from None
    return commit.commit_url


__all__ = [
    "HubPushError",
    "build_model_card",
    "parse_log_history",
    "push_checkpoint",
    "save_hub_checkpoint",
    "upload_plan",
    "write_loss_curve",
]
