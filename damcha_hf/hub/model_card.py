"""The Hub model card of a DAMCHA model: metadata, DAMCHA settings, loading snippets, training and results."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..families import family_for_model_type, family_of
from ..metric_map import MetricMap, is_vision_model
from ..modeling.damcha_config import TESTED_TRANSFORMERS
from ..modeling.variants import VARIANTS
from .file_rules import public_dataset_name
from .training_log import TrainingLog, is_number, parse_log_history

# Stands for the repository id in a card written before the repository is known; `push_checkpoint` fills it in.
REPO_PLACEHOLDER = "your-name/your-damcha-model"
# A copy of a DAMCHA checkpoint's tokenizer, with no config.json beside it. Where the plugin is not installed,
# `AutoTokenizer.from_pretrained(folder)` first reads the folder's config.json (transformers 5.23 to 5.25,
# models/auto/tokenization_auto.py, `AutoTokenizer.from_pretrained`), meets a `model_type` it does not know with remote
# code in `auto_map`, and asks "Do you wish to run the custom code? [y/N]"; no content of the tokenizer files can
# prevent that. From this subfolder it finds no config and loads the tokenizer class the tokenizer files name.
TOKENIZER_SUBFOLDER = "tokenizer"

PAPER_TITLE = "Data-Adaptive Mahalanobis Metric Learning for Cross-Head Attention in Transformers"
CITATION_BIBTEX = f"""@inproceedings{{damcha2026,
  title     = {{{PAPER_TITLE}}},
  booktitle = {{Advances in Neural Information Processing Systems}},
  year      = {{2026}},
  note      = {{Author list not recorded here: take it from the paper}}
}}"""


# --------------------------------------------------------------------------------------------------------- the model


def cross_head_variant(model) -> str:
    """`"damcha"`, or the baseline attention the model runs instead (a name of `damcha_hf.modeling.variants.VARIANTS`)."""
    # Every DAMCHA config has the field; a config without it is a stock transformers model: plain attention.
    return getattr(model.config, "cross_head_variant", "none")


def variant_settings(config) -> list[tuple[str, str]]:
    """The card's rows for the config fields of its attention variant (DAMCHA's `metric_*`, DCMHA's rank)."""
    fields = VARIANTS[config.cross_head_variant].fields
    return [(name, f"`{value}`" if isinstance(value := getattr(config, name), str) else value) for name in fields]


def is_stock_model(model) -> bool:
    """A stock transformers model (`gpt2`, `llama`, `vit` config: the MHA baseline a recipe trains), not a DAMCHA one."""
    return model.config.model_type == family_of(model).model_type


def pipeline_tag_and_auto_class(model) -> tuple[str, str]:
    """The card's pipeline tag and loading Auto class: those its family declares for this head (matched by the DAMCHA
    or the stock class's name, since remote-code classes live in other modules); a base model is a feature
    extractor."""
    name = type(model).__name__
    for head in family_of(model).heads:
        if name in (head.model_class.__name__, getattr(head.stock_class, "__name__", None)) and head.pipeline_tag:
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
    local_folder: str | os.PathLike | None = None,
    has_preprocessor: bool = True,
    tokenizer_subfolder: str | None = None,
    log_source: str = "the `Trainer` log history",
    log_evaluation: str | None = None,
    comparison: Mapping[str, Mapping[str, float]] | None = None,
    notes: Sequence[str] = (),
    samples_description: str | None = None,
) -> ModelCard:
    """A Hub model card for a DAMCHA model, or for a stock transformers model trained as its baseline (no DAMCHA tags,
    settings or remote-code loading for that one).

    Args:
        log_history: a `Trainer`'s `state.log_history` (or a trainer_state.json path): training details, a results
            table and, unless `eval_results` is given, the evaluation results.
        base_model: Hub id of the MHA checkpoint this model was converted from.
        datasets: Hub ids of the training data; the first also names the evaluation data in `model-index`. A local
            path is reduced to its base name (see `damcha_hf.hub.file_rules.public_dataset_name`).
        eval_results: `{"loss": 2.3, "accuracy": 0.81}` (an `eval_` prefix is dropped); overrides the log's.
        images: relative paths of images written next to the card: `{"loss_curve": ..., "metric_heatmap": ...}`.
            `save_hub_checkpoint` writes both and fills this in.
        metric_map: the `MetricMap` behind the heatmap, for the per-layer off-diagonal mass table.
        repo_id: used in the loading snippets; `push_checkpoint` replaces the placeholder with the real id.
        local_folder: the folder the checkpoint is saved in, for a card written before it is pushed: the snippets
            load that folder (named as given when relative, never by an absolute path outside the current folder),
            and `push_checkpoint` writes the repository id in its place.
        tokenizer_subfolder: the subfolder holding a copy of the tokenizer without a config.json
            (`TOKENIZER_SUBFOLDER`, written by `save_hub_checkpoint`): the snippet without the plugin loads it from
            there with `AutoTokenizer`. None: that snippet loads the tokenizer files beside the weights with
            `PreTrainedTokenizerFast`, which reads no config.json either.
        log_source: what `log_history` is, for the training section (e.g. "the demo's training loop").
        log_evaluation: what the log's evaluations ran on, where that is not what `eval_results` ran on (e.g. "on
            the first 256 of the 1,024 validation blocks; the evaluation results use all of them"): said under the
            training results, and where the last of them differs from `eval_results`.
        comparison: `{"MHA baseline": {"bits_per_byte": 2.1}, ...}`: models trained the same way, shown in a table
            beside this model's `eval_results` (never as this model's metrics).
        notes: sentences added to the limitations.
        samples_description: how the images of `images["samples"]` (a generative model's samples) were made.
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
    family = family_of(model).model_type
    pipeline_tag, auto_class = pipeline_tag_and_auto_class(model)
    log = parse_log_history(log_history) if log_history is not None else None
    results = resolve_eval_results(model, log, eval_results)

    stock = is_stock_model(model)
    # Until the checkpoint is pushed, its snippets load the folder it is saved in (when it can be named publicly).
    shown_folder = snippet_folder(local_folder) if local_folder is not None and repo_id == REPO_PLACEHOLDER else None
    default_name = f"{family}-mha-baseline" if stock else f"damcha-{family}"
    model_name = model_name or (repo_id.split("/")[-1] if repo_id != REPO_PLACEHOLDER else default_name)
    eval_dataset = datasets[0] if datasets else "custom"
    card_data = ModelCardData(
        library_name="transformers",
        license=license,
        pipeline_tag=pipeline_tag,
        # A stock model is the baseline: no DAMCHA tags, and no custom code (transformers' own classes load it).
        tags=[family] if stock else ["damcha", "cross-head-attention", family, "custom_code"],
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
    family_name, variant = family_of(model).display_name, cross_head_variant(model)
    if stock:
        introduction = (
            f"A stock transformers {family_name} model ({type(model).__name__}) with plain multi-head attention and "
            "no custom code, trained by damcha-hf's recipes as the multi-head-attention baseline that DAMCHA models "
            "are compared against."
        )
        settings = []
    elif variant == "damcha":
        introduction = (
            f"A {family_name} model ({type(model).__name__}) with **DAMCHA** attention, data-adaptive cross-head "
            f"metric attention from *{PAPER_TITLE}* (NeurIPS 2026): each head scores its queries against a mixture "
            "of every head's keys, `K~_i = sum_j C_ij(x) K_j`, with the cross-head matrix `C = I + G(x)` produced "
            "from the layer's input by a small metric-generator MLP. Everything else is the standard "
            f"{family_name} architecture."
        )
        settings = variant_settings(config)
    else:
        introduction = (
            f"A {family_name} model ({type(model).__name__}) trained as a **baseline** for DAMCHA (*{PAPER_TITLE}*, "
            f"NeurIPS 2026): its attention is {VARIANTS[variant].description} "
            f'(`cross_head_variant="{variant}"`), run by the same damcha-hf code so that comparisons differ only '
            "in attention."
        )
        settings = [("cross_head_variant", f"`{variant}`"), *variant_settings(config)]
    sections = [
        f"# {model_name}",
        (
            introduction
            + (
                f"\n\nFine-tuned from [`{base_model}`](https://huggingface.co/{base_model})."
                if base_model and stock
                else f"\n\nConverted from [`{base_model}`](https://huggingface.co/{base_model}): every pretrained weight "
                "was kept and the new cross-head parameters started at the identity (for DAMCHA: the metric "
                "generator at zero, `C = I`), so before fine-tuning the model computed exactly the original "
                "multi-head attention."
                if base_model
                else ""
            )
        ),
        ("## Model settings\n\n" if stock else "## DAMCHA settings\n\n")
        + markdown_table(
            ("setting", "value"),
            settings
            + [
                (
                    "layers x heads x width",
                    f"{config.num_hidden_layers} x {config.num_attention_heads} x {config.hidden_size}",
                ),
                ("parameters", total),
            ]
            + (
                []
                if stock
                else [
                    (
                        f"{VARIANTS[variant].parameter_kind} parameters",
                        f"{generator:,} ({100 * generator / total:.3f}% of the model)",
                    )
                ]
            ),
        ),
        loading_section(
            auto_class,
            repo_id,
            family,
            has_preprocessor,
            stock=stock,
            tokenizer_subfolder=tokenizer_subfolder,
            local_folder=shown_folder,
        ),
    ]
    if "metric_heatmap" in images or metric_map is not None:
        sections.append(metric_section(images.get("metric_heatmap"), metric_map))
    if "samples" in images:
        sections.append(
            f"## Samples\n\n![Samples generated by the model]({images['samples']})\n\n"
            + (samples_description or "Images generated by the model.")
        )
    sections.append(training_section(log, images.get("loss_curve"), log_source, log_evaluation))
    sections.append(
        evaluation_section(
            results, eval_dataset if datasets else None, from_log=eval_results is None, log=log,
            log_evaluation=log_evaluation,
        )
    )  # fmt: skip
    if comparison:
        sections.append(comparison_section(model_name, results, comparison))
    limitations = (
        STOCK_LIMITATIONS
        if stock
        else LIMITATIONS.format(tested=tested_releases(), family=family_of(model).display_name)
    )
    sections.append(limitations + "".join(f"\n- {note}" for note in notes))
    if not stock:
        sections.append(
            "## Citation\n\nThe authors of the DAMCHA paper are not recorded in this card (we did not have the author "
            "list when it was written); please complete the entry from the paper before citing it.\n\n"
            f"```bibtex\n{CITATION_BIBTEX}\n```"
        )
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)


def loading_snippet(
    auto_class: str,
    repo_id: str,
    family: str,
    has_preprocessor: bool,
    *,
    plugin: bool,
    stock: bool = False,
    tokenizer_subfolder: str | None = None,
) -> str:
    """The Python lines that load the checkpoint `repo_id` (a Hub id or a folder): with the plugin imported, or
    without it (remote code, unless `stock`), with its tokenizer or image processor when it has one."""
    vision = family_for_model_type(family).vision
    lines = ["import damcha_hf  # registers the DAMCHA classes with the Auto classes"] if plugin else []
    suffix = "" if plugin or stock else ", trust_remote_code=True"
    # The tokenizer and image processor are transformers' own classes: they load without remote code.
    # `AutoImageProcessor` finds its class in preprocessor_config.json. Without the plugin, `AutoTokenizer` on the
    # checkpoint would read config.json first and stop at the remote-code prompt (see TOKENIZER_SUBFOLDER); it
    # loads from the tokenizer's own subfolder, and `PreTrainedTokenizerFast` reads only the tokenizer files.
    location = json.dumps(repo_id)
    preprocessor_arguments = location
    if vision:
        preprocessor_class = "AutoImageProcessor"
    elif plugin or stock:
        preprocessor_class = "AutoTokenizer"
    elif tokenizer_subfolder:
        preprocessor_class = "AutoTokenizer"
        preprocessor_arguments += f', subfolder="{tokenizer_subfolder}"'
    else:
        preprocessor_class = "PreTrainedTokenizerFast"
    imports = f"{auto_class}, {preprocessor_class}" if has_preprocessor else auto_class
    lines += [
        f"from transformers import {imports}",
        "",
        f"model = {auto_class}.from_pretrained({location}{suffix})",
    ]
    if has_preprocessor:
        name = "image_processor" if vision else "tokenizer"
        lines.append(f"{name} = {preprocessor_class}.from_pretrained({preprocessor_arguments})")
    return "\n".join(lines)


# Marks the sentence of a card whose snippets load a local folder: `card_for_repository` finds the folder in it,
# writes the repository id in its place and drops the sentence (HTML comments do not show on the Hub).
LOCAL_FOLDER_NOTE = re.compile(
    r"<!-- local folder: (?P<folder>\"(?:[^\"\\]|\\.)*\") -->.*?<!-- /local folder -->\n*", re.DOTALL
)


def snippet_folder(folder: str | os.PathLike) -> str | None:
    """How a card's snippets name the folder a checkpoint is saved in: as given when relative (`./damcha-demo`),
    relative to the current folder when it lies inside it; None (use the placeholder id) for a folder elsewhere, whose
    absolute path must not reach a file meant for publication."""
    folder = os.fspath(folder)
    if os.path.isabs(folder):
        relative = os.path.relpath(folder)
        if relative.startswith(os.pardir):
            return None
        folder = os.path.join(os.curdir, relative)
    if folder.startswith(("~", os.pardir)) or "\n" in folder:
        return None
    return folder


def card_for_repository(card_text: str, repo_id: str) -> str:
    """The card as pushed to `repo_id`: the snippets name `repo_id` where they named the placeholder or the local
    folder the checkpoint was saved in, and the sentence about that folder is gone."""
    text = card_text.replace(REPO_PLACEHOLDER, repo_id)
    for match in list(LOCAL_FOLDER_NOTE.finditer(text)):
        text = text.replace(match.group(0), "").replace(match.group("folder"), json.dumps(repo_id))
    return text


def loading_section(
    auto_class: str,
    repo_id: str,
    family: str,
    has_preprocessor: bool,
    stock: bool = False,
    tokenizer_subfolder: str | None = None,
    local_folder: str | None = None,
) -> str:
    vision = family_for_model_type(family).vision
    location = local_folder or repo_id

    def snippet(plugin: bool) -> str:
        code = loading_snippet(auto_class, location, family, has_preprocessor, plugin=plugin, stock=stock,
                               tokenizer_subfolder=tokenizer_subfolder)  # fmt: skip
        return f"```python\n{code}\n```"

    where = (
        f"<!-- local folder: {json.dumps(local_folder)} -->These snippets load the local folder `{local_folder}` (a "
        "path relative to the folder the checkpoint was saved from); `damcha-hf push "
        f"{local_folder} <namespace/name>` (or `damcha_hf.hub.push_checkpoint`) writes the Hub repository id in its "
        "place.<!-- /local folder -->\n\n"
        if local_folder
        else ""
    )
    if stock:  # transformers' own classes: no plugin, no remote code
        return "## How to load\n\n" + where + snippet(plugin=False)
    return (
        "## How to load\n\n"
        + where
        + "With the `damcha-hf` plugin installed (it is not on PyPI: in a clone of its repository, `pip install -e .`):"
        "\n\n"
        + snippet(plugin=True)
        + "\n\nWithout the plugin: the repository carries the model code (`configuration_damcha_*.py`, "
        "`modeling_damcha_*.py`, the attention variant's `variant_*.py` and the files they import: this family's and "
        "this variant's code only, which imports only torch and transformers), which "
        "transformers runs when you allow remote code. Read it first: it executes on your machine.\n\n"
        + snippet(plugin=False)
        + (
            f"\n\nThe tokenizer needs no remote code. `{tokenizer_subfolder}/` holds a copy of it without a "
            f'`config.json`, so `AutoTokenizer.from_pretrained(..., subfolder="{tokenizer_subfolder}")` loads it '
            "without `trust_remote_code` and without a prompt; from the top folder, `AutoTokenizer` without the "
            "plugin reads `config.json` first and asks whether to run the model code."
            if tokenizer_subfolder and has_preprocessor and not vision
            else ""
        )
        + "\n\n`config.json` maps every Auto class of the family (`auto_map`), so the same checkpoint also loads "
        "with `AutoModel` and the other task heads."
    )


def metric_section(image: str | None, metric_map: MetricMap | None) -> str:
    averaged_over = metric_map.inputs if metric_map is not None else "a few sample inputs"
    text = (
        "## Learned cross-head metric\n\nThe cross-head matrix `C` of each layer, averaged over the tokens of "
        f"{averaged_over}. `C = I` is plain multi-head attention; off-diagonal entries are how much head `i` scores "
        "against head `j`'s keys."
    )
    if image:
        text += f"\n\n![Mean cross-head matrix C per layer]({image})"
    if metric_map is not None:
        text += "\n\nOff-diagonal mass `sum_{i!=j} |C_ij| / sum_ij |C_ij|` of the mean matrix:\n\n" + markdown_table(
            ("layer", "off-diagonal mass"),
            [(name, f"{mass:.4f}") for name, mass in zip(metric_map.layer_names, metric_map.offdiagonal_mass)],
        )
    return text


MAX_RESULT_ROWS = 25


def training_section(
    log: TrainingLog | None,
    loss_curve: str | None,
    source: str = "the `Trainer` log history",
    log_evaluation: str | None = None,
) -> str:
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
        facts.append(f"- final logged training loss: {format_metric(log.train_losses[-1][1])}")
    if is_number(log.summary.get("train_loss")):
        facts.append(f"- mean training loss: {format_metric(log.summary['train_loss'])}")
    if is_number(log.summary.get("train_runtime")):
        facts.append(f"- training time: {log.summary['train_runtime'] / 60:.1f} min")
    text = f"## Training details\n\nFrom {source}:\n\n" + "\n".join(facts)
    if loss_curve:
        text += f"\n\n![Training and validation loss]({loss_curve})"
    rows = results_rows(log)
    if rows:
        header, body = rows
        text += "\n\n### Training results\n\n" + markdown_table(header, body)
        legend = []
        if "training loss" in header:
            legend.append("training loss: the loss on training batches, as logged at that step (or last before it)")
        if any(name.startswith("validation ") for name in header):
            legend.append(
                "validation: held-out evaluation at that step" + (f", {log_evaluation}" if log_evaluation else "")
            )
        if legend:
            legend = "; ".join(legend)
            text += f"\n\n{legend[0].upper()}{legend[1:]}."
    return text


def results_rows(log: TrainingLog) -> tuple[list[str], list[list[str]]] | None:
    """One row per evaluation step (else per logged training loss): step, epoch, training loss, metrics, as text.

    A column no row fills is left out (a run without epochs, or one evaluated before its first logged training
    loss); a value one row lacks is shown as "–". Steps are counts, epochs two decimals, losses and metrics four."""
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
    filled = [index for index in range(len(header)) if any(row[index] is not None for row in body)]
    formats = {"step": lambda step: f"{int(step):,}", "epoch": lambda epoch: f"{epoch:.2f}"}
    header = [header[index] for index in filled]
    body = [
        [
            format_metric(None) if row[index] is None else formats.get(name, format_metric)(row[index])
            for index, name in zip(filled, header)
        ]
        for row in body
    ]
    return header, body


def evaluation_section(
    results: Mapping[str, float],
    dataset: str | None,
    from_log: bool,
    log: TrainingLog | None = None,
    log_evaluation: str | None = None,
) -> str:
    if not results:
        return "## Evaluation results\n\nNo evaluation results were recorded with this checkpoint."
    source = "the last evaluation in the training log" if from_log else "the evaluation run given with this card"
    on = f" on `{dataset}`" if dataset else ""
    text = f"## Evaluation results\n\nFrom {source}{on}:\n\n" + markdown_table(
        ("metric", "value"), [(name, format_metric(value)) for name, value in results.items()]
    )
    differing = [] if from_log or log is None else differing_from_log(results, log)
    if differing:
        step = log.eval_entries[-1]["step"]
        why = log_evaluation or "the training log evaluated on its own data, these figures come from another run"
        text += (
            f"\n\n{', '.join(differing)} {'differs' if len(differing) == 1 else 'differ'} from the last row of the "
            "training results"
            + (f" (step {step:,})" if step is not None else "")
            + f": that row is an evaluation during training, {why}."
        )
    return text


def differing_from_log(results: Mapping[str, float], log: TrainingLog) -> list[str]:
    """The metrics of `results` that the log's last evaluation also has, with another value (as the card shows them)."""
    final = log.final_eval
    return [
        name for name, value in results.items() if name in final and format_metric(final[name]) != format_metric(value)
    ]


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
    """A loss or metric as every table of the card shows it: four decimals (a loss of 1.99996 reads 2.0000, not 2)."""
    return "–" if value is None else f"{value:.4f}"


def tested_releases() -> str:
    """The transformers releases the model code is tested with, from the one list (`TESTED_TRANSFORMERS`)."""
    *earlier, last = TESTED_TRANSFORMERS
    return "transformers " + (f"{', '.join(earlier)} and {last}" if earlier else last)


LIMITATIONS = """## Limitations

- DAMCHA's published gains are small on several benchmarks and reported as single runs; the damcha-hf authors'
  small-scale prototype found effects within the seed spread. Compare against a multi-head-attention baseline
  trained the same way before relying on an improvement.
- `C` is neither symmetric nor positive definite: the score is a learned bilinear form, not a true Mahalanobis
  metric (the paper says so too).
- The model code extends transformers' {family} internals and was tested with the releases damcha-hf's
  continuous integration runs ({tested}); other releases may change those internals.
- The model inherits the biases and failure modes of its training data and of any base checkpoint."""

STOCK_LIMITATIONS = """## Limitations

- A small model trained briefly as a comparison baseline, not a general-purpose model.
- The model inherits the biases and failure modes of its training data and of any base checkpoint."""
