"""`save_hub_checkpoint`: a complete, Hub-ready checkpoint folder of a model, written atomically."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..metric_map import is_vision_model, write_metric_map
from ..safe_files import (
    METRIC_HEATMAP_FILE,
    apply_umask,
    check_checkpoint_folder,
    check_checkpoint_location,
    write_save_record,
)
from ..safe_files.atomic_files import atomic_write, make_staging_folder, save_lock_file, wait_for_lock
from .file_rules import CARD_FILE, CONFIG_FILES, LOSS_CURVE_FILE, SAMPLE_GRID_FILE
from .model_card import TOKENIZER_SUBFOLDER, build_model_card, cross_head_variant
from .push import check_no_local_paths, completed_config, config_json_bytes, upload_plan
from .training_log import write_loss_curve


def save_hub_checkpoint(
    model,
    folder: str | os.PathLike,
    *,
    tokenizer_or_processor=None,
    log_history=None,
    base_model: str | None = None,
    datasets: str | Sequence[str] | None = None,
    heatmap_inputs=None,
    heatmap_description: str | None = None,
    metric_heatmap: bool = True,
    license: str = "apache-2.0",
    eval_results: Mapping[str, float] | None = None,
    model_name: str | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, str | bytes] | None = None,
    baseline_log_histories: Mapping[str, object] | None = None,
    sample_grid: bytes | None = None,
    sample_grid_description: str | None = None,
    **card_fields,
) -> Path:
    """Write a complete Hub checkpoint of `model` into `folder`, atomically, and return `folder`.

    Contents: `model.safetensors` (or shards), `config.json` (with `auto_map`), `generation_config.json` for
    generative models, the model code, the tokenizer or image processor, `README.md` (see `build_model_card`),
    `loss_curve.png` (when `log_history` logged a loss) and `metric_heatmap.png` (unless `metric_heatmap=False`).
    A DAMCHA model's tokenizer is also saved in `tokenizer/`, without a config.json, where `AutoTokenizer` loads it
    without the plugin and without remote code (`AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")`).

    Args:
        model: a DAMCHA `PreTrainedModel` (merge LoRA adapters first: `model.merge_and_unload()`).
        tokenizer_or_processor: saved with `save_pretrained`; a tokenizer also tokenises the heatmap text.
        log_history, base_model, datasets, license, eval_results, model_name: see `build_model_card`.
        heatmap_inputs: inputs for the metric heatmap (`damcha_hf.metric_map.compute_metric_map` accepts a tensor,
            a dict of model inputs, a list of them, or texts); None uses the built-in sample that `damcha-hf inspect`
            uses by default. `heatmap_description` says in words what the given inputs are, for the card.
        overwrite: replace an existing `folder` that holds an earlier save of this function and nothing else: each
            save lists the files it wrote in `.damcha-hf-files.json`, and only those are replaced. A folder holding
            anything else (a Trainer `output_dir`, your own files, a checkpoint saved without that record), the
            current folder, its parents and the home folder are never replaced: `UnsafeOutputError` (an `OSError`)
            is raised, naming the files, before anything is written. Use a subfolder such as `output_dir/"hub"`.
        extra_files: `{file name: text or bytes}` written beside the checkpoint in the same atomic step (e.g. a
            run's results); the record lists them with the save's other files.
        baseline_log_histories: `{"MHA": log_history}` of models trained alongside: drawn in the loss curve too.
        sample_grid: PNG bytes of images the model generated (a diffusion model's samples), written as
            `sample_grid.png` and shown in the card with `sample_grid_description` (how they were sampled).
        card_fields: `log_source`, `comparison`, `notes` of `build_model_card`.

    Everything is written into a temporary folder beside `folder`, the record last, and renamed into place, so
    `folder` is never left half-written; what a killed save leaves beside it is restored or removed by the next save
    into `folder` (`damcha_hf.safe_files.recover_interrupted_saves`). Saves into one `folder` run one at a time: a
    second one (another process or thread) waits for the first, saying so on stderr, while that one holds the lock
    file `.NAME.damcha-hf-save.lock` beside `folder` (removed when its save ends).
    """
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"save_hub_checkpoint needs a transformers PreTrainedModel, got {type(model).__name__}; unwrap it first "
            "(`accelerator.unwrap_model(model)`, or `model.merge_and_unload()` for a PEFT model)."
        )
    extra_files = dict(extra_files or {})
    for name in extra_files:
        if name != os.path.basename(name) or name in ("", ".", "..") or name in CONFIG_FILES:
            raise ValueError(f"extra_files: {name!r} must be a plain file name, not a path or a config file.")
    argument = "save_hub_checkpoint folder"
    folder = check_checkpoint_location(folder, argument=argument)  # refused before anything is written beside it
    # One save at a time into `folder` (another process's or thread's waits), so that every check below sees the
    # folder as a finished save left it, and the folder ends as one complete checkpoint.
    lock = wait_for_lock(save_lock_file(folder), what=f"{argument} {folder}")
    staging = None
    try:
        check_checkpoint_folder(folder, argument=argument, replace=overwrite)
        staging = make_staging_folder(folder)
        model.save_pretrained(staging)
        config, changed = completed_config(staging)
        if changed:
            atomic_write(staging / "config.json", config_json_bytes(config))
        tokenizer_subfolder = None
        if tokenizer_or_processor is not None:
            preprocessor = fitted_to_context(tokenizer_or_processor, model.config)
            preprocessor.save_pretrained(staging)
            if isinstance(preprocessor, PreTrainedTokenizerBase) and "AutoConfig" in (config.get("auto_map") or {}):
                tokenizer_subfolder = TOKENIZER_SUBFOLDER  # see there: AutoTokenizer's way around config.json
                preprocessor.save_pretrained(staging / tokenizer_subfolder)
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
            metric_map = write_metric_map(
                model, staging / METRIC_HEATMAP_FILE, heatmap_inputs, tokenizer=tokenizer,
                description=heatmap_description,
            )  # fmt: skip
            images["metric_heatmap"] = METRIC_HEATMAP_FILE
        if sample_grid is not None:
            atomic_write(staging / SAMPLE_GRID_FILE, sample_grid)
            images["samples"] = SAMPLE_GRID_FILE
            card_fields = {"samples_description": sample_grid_description, **card_fields}
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
            tokenizer_subfolder=tokenizer_subfolder,
            **card_fields,
        )
        atomic_write(staging / CARD_FILE, str(card))
        for name, content in extra_files.items():
            atomic_write(staging / name, content)
        check_no_local_paths(staging, upload_plan(staging).values(), extra=[folder])
        apply_umask(staging)
        write_save_record(staging)  # last: a staging folder without it is an unfinished save
        replace_folder(staging, folder, overwrite=overwrite)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        lock.release()
    return folder


def fitted_to_context(tokenizer_or_processor, config):
    """A tokenizer whose `model_max_length` is the model's context (`max_position_embeddings`: GPT-2's `n_positions`),
    so that `tokenizer(..., truncation=True)` cuts inputs where the model's positions end and longer inputs are
    flagged; a copy, the caller's tokenizer is left as it is. Anything else (an image processor) is returned as is."""
    context = getattr(config, "max_position_embeddings", None)
    if not context or getattr(tokenizer_or_processor, "model_max_length", context) == context:
        return tokenizer_or_processor
    fitted = copy.copy(tokenizer_or_processor)
    fitted.model_max_length = context
    return fitted


def replace_folder(new: Path, target: Path, *, overwrite: bool) -> None:
    """Rename `new` to `target`, under the save lock of `target`. An existing `target` is checked again (something
    other than a save may have changed it meanwhile: only the files an earlier save recorded are replaced), moved
    aside, and deleted once `new` is in place."""
    if target.exists():
        check_checkpoint_folder(target, argument="save_hub_checkpoint folder", replace=overwrite)
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
