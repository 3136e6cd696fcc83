#!/usr/bin/env python
"""DAMCHA-upgrade a pretrained decoder (GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2) or ViT cheaply: LoRA on
the attention and MLP projections, the metric generator trained in full (PEFT `modules_to_save=["cross_head_metric"]`),
everything else frozen.

    # GPT-2 (a local GPT-2 or DAMCHA GPT-2 checkpoint folder), language modelling on local text:
    python recipes/finetune_lora.py --base path/to/gpt2 --data corpus.txt --output-dir runs/lora-gpt2 --merge
    # Llama (Llama 2/3, TinyLlama, SmolLM, ...; grouped-query attention included), the same way:
    python recipes/finetune_lora.py --base path/to/tinyllama --data corpus.txt --output-dir runs/lora-llama --merge
    # Mistral, Qwen2 / Qwen2.5, Qwen3, Phi-3 and Gemma 2 the same way (a local folder of the checkpoint):
    python recipes/finetune_lora.py --base path/to/qwen2.5-0.5b --data corpus.txt --output-dir runs/lora-qwen2 --merge
    # ViT (a local ViT or DAMCHA ViT checkpoint folder), classification on an image folder or Fashion-MNIST:
    python recipes/finetune_lora.py --base path/to/vit --data path/to/images --output-dir runs/lora-vit --merge

Data as in `train_gpt2.py` and `train_vit.py`: the --data presets, or `--dataset-name` / `--train-file` through
`datasets` with `--text-column-name` (decoders) or `--image-column-name` and `--label-column-name` (ViT).

A plain (stock) checkpoint is converted with `damcha_hf.convert_to_damcha` (every weight kept, generator at zero, so
training starts from the pretrained model's exact outputs). The architecture is read from the checkpoint's
`model_type`, and everything the recipe needs about it from its family declaration (`damcha_hf.families`). LoRA
targets: GPT-2 `c_attn`, `c_proj`, `c_fc`; Llama, Mistral, Qwen2, Qwen3 and Gemma 2 `q_proj`, `k_proj`, `v_proj`,
`o_proj`, `gate_proj`, `up_proj`, `down_proj`; Phi-3 its fused `qkv_proj` and `gate_up_proj`, and `o_proj`,
`down_proj`; ViT `q_proj`, `k_proj`, `v_proj`, `o_proj`, `fc1`, `fc2` (the ViT classifier is trained in full too, since
a new dataset needs a new head). The adapter goes to `<output-dir>/adapter`; with `--merge` the LoRA weights are merged
and `<output-dir>/merged` is a plain DAMCHA checkpoint (no PEFT needed to load it).

A language model's adapter reloads with plain PEFT: the DAMCHA model LoRA was trained on (the converted base, with its
model code) is saved to `<output-dir>/base`, and the adapter's README.md says how to load it. The adapter's
`base_model_name_or_path` is never an absolute path (it would publish the machine's folder layout with the adapter
and mean nothing elsewhere): `--base-model-id` when given (the Hub id you publish `<output-dir>/base` under), else
the base folder relative to the current folder (`runs/lora-.../base`, which PEFT resolves against the folder you
load from), or `../base` (relative to the adapter) when the run folder is outside the current folder:

    from peft import AutoPeftModelForCausalLM
    model = AutoPeftModelForCausalLM.from_pretrained("runs/lora-.../adapter", trust_remote_code=True)
    # from any folder: name the base yourself
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained("runs/lora-.../base", trust_remote_code=True)
    model = PeftModel.from_pretrained(base, "runs/lora-.../adapter")
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Standard library only: torch, transformers and peft are imported after the arguments are parsed.
import image_data
import recipe_options
import run_folder
import text_data

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources, safe_files
from damcha_hf.safe_files.atomic_files import write_json


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    parser.add_argument("--base", required=True, help="a local checkpoint folder (stock or DAMCHA) of GPT-2, Llama, "
                        "Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 or ViT")  # fmt: skip
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora-rank", type=checks.positive_int, default=8)
    lora.add_argument("--lora-alpha", type=checks.positive_float, default=16)
    lora.add_argument("--lora-dropout", type=checks.probability, default=0.0)
    lora.add_argument("--freeze-generator", action="store_true", help="do not train the metric generator")
    lora.add_argument("--merge", action="store_true", help="merge LoRA into the weights and save <output-dir>/merged")
    lora.add_argument("--base-model-id", type=checks.hub_id, help="the Hub id you publish <output-dir>/base under (e.g. "
                      "your-name/damcha-gpt2-base), written as the adapter's base_model_name_or_path so that "
                      "AutoPeftModelForCausalLM loads the adapter anywhere (default: <output-dir>/base relative to "
                      "the current folder, or ../base when the run folder is outside it)")  # fmt: skip
    data = parser.add_argument_group("data (decoders: text; ViT: images)")
    data.add_argument("--data", help="decoders: text file/folder/glob/'stdlib'/'gcide'; ViT: image folder or "
                      "'fashion-mnist' (default: 'stdlib' or 'fashion-mnist')")  # fmt: skip
    data.add_argument("--file-pattern", default="**/*.txt")
    data.add_argument("--max-data-bytes", type=checks.positive_int)
    data.add_argument("--validation-fraction", type=checks.probability, default=0.05)
    data.add_argument(
        "--block-size", type=checks.positive_int, default=128, help="language-model context length in tokens"
    )
    data.add_argument("--fashion-mnist-dir", default="/usr/share/datasets/fashion-mnist")
    data.add_argument("--image-size", type=checks.positive_int, help="ViT: default the base model's image size")
    data.add_argument("--no-augment", action="store_true", help="ViT: no random crop / flip of training images")
    data_sources.add_dataset_arguments(data, task_columns={
        "--text-column-name": ("text", "decoders: the column of --dataset-name / --train-file holding the text"),
        "--image-column-name": ("image", "ViT: the column holding the images"),
        "--label-column-name": ("label", "ViT: the column holding each image's class (names or ids)"),
    })  # fmt: skip
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/lora-{settings}", batch_size=16, learning_rate=1e-3,
                                  max_steps=500, output_dir_example="runs/lora-gpt2-corpus for --base path/to/gpt2 "
                                  "--data corpus.txt")  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=lambda args: recipe_options.run_folder_name(
        args.base, args.cross_head_variant, args.metric_context, data_label(args)))  # fmt: skip
    if not os.path.isfile(os.path.join(args.base, "config.json")):
        parser.error(f"--base {args.base}: not a checkpoint folder (no config.json)")
    checks.check_output(parser, safe_files.check_checkpoint_files, args.base)
    if str(recipe_options.saved_model_type(args.base)).endswith("bart"):
        parser.error(f"--base {args.base}: a BART encoder-decoder; this recipe adapts decoder language models and "
                     "image classifiers: train BART with recipes/train_bart.py")  # fmt: skip
    check_base_architecture(parser, args)
    recipe_options.check_variant_flags(
        parser, args, checkpoint=args.base, checkpoint_flag="--base", converts_plain_checkpoint=True
    )
    vision = str(recipe_options.saved_model_type(args.base)).endswith("vit")
    check_data_flags_fit_the_base(parser, args, vision)
    if vision:
        if args.data is not None and not data_sources.uses_datasets_flags(args):
            image_data.check_image_data(parser, args.data)
    else:
        recipe_options.check_causal_metric_context(parser, args)
        if args.data is not None:
            try:
                checks.text_data_source(args.data)
            except argparse.ArgumentTypeError as error:
                parser.error(f"--data {error}")
    if args.push_to_hub and not args.base_model_id:
        parser.error("--push-to-hub uploads the adapter and its base (<output-dir>/base); name the base's Hub id with "
                     "--base-model-id (e.g. your-name/damcha-base), the adapter's with --hub-model-id")  # fmt: skip
    args.tokenizer = "byte"
    return args


def data_label(args) -> str | None:
    """What the data are called (run folder, model card): --dataset-name, --train-file or --data (None: the default
    of the base's task, settled once the base is read)."""
    return args.dataset_name or args.train_file or args.data


def check_data_flags_fit_the_base(parser, args, vision: bool) -> None:
    """The data flags together (`data_sources.check_dataset_arguments`), and only the column flags of the base's task:
    the text column for a decoder, the image and label columns for a ViT."""
    own = image_data.IMAGE_COLUMN_FLAGS if vision else text_data.TEXT_COLUMN_FLAGS
    other = text_data.TEXT_COLUMN_FLAGS if vision else image_data.IMAGE_COLUMN_FLAGS
    for flag, name in other.items():
        if name in args.explicit:
            task = "a ViT base (images)" if vision else "a decoder base (text)"
            parser.error(f"{flag} does not apply to {task}; leave it out")
    data_sources.check_dataset_arguments(parser, args, columns=own)


def check_base_architecture(parser, args) -> None:
    """Refuse a --base of an architecture no family declares, naming the ones this recipe adapts; take eager attention
    for a family whose stock model runs no SDPA (Gemma 2: SDPA cannot soft-cap the logits) unless --attn says more."""
    from damcha_hf.families import FAMILIES, family_for_model_type, supported_architectures

    model_type = recipe_options.saved_model_type(args.base)
    family = family_for_model_type(model_type)
    if family is None:
        adapted = supported_architectures([family for family in FAMILIES if not family.encoder_decoder])
        parser.error(f"--base {args.base}: a {model_type!r} checkpoint, an architecture damcha_hf does not support; "
                     f"this recipe adapts {adapted} checkpoints and their DAMCHA versions")  # fmt: skip
    if args.attn == "sdpa" and not family.task_head.model_class._supports_sdpa:
        if "attn" in args.explicit:
            parser.error(f"--attn sdpa: {family.display_name} models run eager, flash or flex attention, not SDPA (as "
                         "in transformers); use --attn eager")  # fmt: skip
        args.attn = "eager"


def load_base(args):
    """(config, family) of the base checkpoint: its config (stock or DAMCHA) and its `DamchaFamily` declaration."""
    from transformers import AutoConfig

    from damcha_hf.families import FAMILIES, family_for_model_type

    config = AutoConfig.from_pretrained(args.base)
    family = family_for_model_type(config.model_type)
    if family is None:
        stock = " / ".join(f.model_type for f in FAMILIES)
        damcha = " / ".join(f.damcha_model_type for f in FAMILIES)
        raise ValueError(
            f"--base {args.base!r} is a {config.model_type!r} checkpoint; this recipe upgrades {stock} (or their "
            f"DAMCHA versions, {damcha})."
        )
    return config, family


def cross_head_modules(config) -> list[str]:
    """The modules trained in full beside LoRA: DAMCHA's metric generator, or a baseline's per-layer head mixing."""
    variant = config.cross_head_variant
    return {"damcha": ["cross_head_metric"], "none": []}.get(variant, ["cross_head_mixing"])


def build_model(args, config, family, num_labels=None, labels=None):
    label_maps = {}
    if labels is not None:
        label_maps = {"num_labels": num_labels, "id2label": dict(enumerate(labels)),
                      "label2id": {name: i for i, name in enumerate(labels)}, "ignore_mismatched_sizes": True}  # fmt: skip
    import transformers

    import damcha_hf

    options = recipe_options.metric_options(args)
    head = family.task_head
    with safe_files.loading_checkpoint(args.base, "the --base checkpoint"):
        if config.model_type == family.model_type:  # a stock checkpoint: load it as it is, then convert it exactly
            base = head.stock_class.from_pretrained(args.base, attn_implementation=args.attn, **label_maps)
            return damcha_hf.convert_to_damcha(base, **options)
        auto_class = getattr(transformers, head.auto_class)
        return auto_class.from_pretrained(args.base, attn_implementation=args.attn, **label_maps, **options)


# Flags that shape the trained modules, checked on --resume against the run's `run_settings.json`.
LORA_RESUME_FLAGS = {**{field: field for field in recipe_options.METRIC_FIELDS}, "lora_rank": "lora_rank",
                     "lora_alpha": "lora_alpha", "freeze_generator": "freeze_generator"}  # fmt: skip


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    if resume:
        run_folder.check_resume_settings(args, resume, LORA_RESUME_FLAGS, run_folder.saved_model_config(resume))
    datasets = run_folder.card_datasets(data_label(args)) if data_label(args) else None  # settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, set_seed

    from damcha_hf.data import check_tokenizer_matches_model
    from damcha_hf.metrics import accuracy_compute_metrics, causal_lm_compute_metrics, causal_lm_token_nll

    set_seed(args.seed)
    config, family = load_base(args)

    if not family.vision:
        from transformers import AutoTokenizer

        args.data = args.data or "stdlib"
        datasets = datasets or run_folder.card_datasets(args.data)
        has_tokenizer = os.path.isfile(os.path.join(args.base, "tokenizer.json")) or os.path.isfile(
            os.path.join(args.base, "vocab.json")
        )
        corpus = text_data.load_language_model_corpus(args)
        tokenizer = (
            AutoTokenizer.from_pretrained(args.base) if has_tokenizer else text_data.build_tokenizer(args, corpus)
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        args.block_size = min(args.block_size, config.max_position_embeddings)
        tokenizer.model_max_length = config.max_position_embeddings  # what the adapter's checkpoints save
        train, validation = text_data.language_model_data(args, tokenizer, corpus)
        model = build_model(args, config, family)
        check_tokenizer_matches_model(tokenizer, model.config)
        text_data.use_causal_lm_loss(model)
        processing, collator = tokenizer, DataCollatorForLanguageModeling(tokenizer, mlm=False)
        metrics_kwargs = {"compute_metrics": causal_lm_compute_metrics(tokenizer),
                          "preprocess_logits_for_metrics": causal_lm_token_nll}  # fmt: skip
    else:
        args.data = args.data or "fashion-mnist"
        datasets = datasets or run_folder.card_datasets(args.data)
        args.image_size = args.image_size or config.image_size
        splits, labels, channels, image_size = image_data.image_datasets(args)
        if channels != config.num_channels:
            raise ValueError(f"--data has {channels}-channel images but the base ViT expects {config.num_channels}.")
        processing = image_data.image_processor(image_size, channels)
        image_data.attach_image_transforms(splits, processing, augment=not args.no_augment, image_size=image_size)
        train, validation = splits["train"], splits["validation"]
        model = build_model(args, config, family, len(labels), labels)
        collator, metrics_kwargs = image_data.image_collate, {"compute_metrics": accuracy_compute_metrics()}

    # The DAMCHA model LoRA trains on, saved before PEFT wraps its modules: the adapter's base (`AutoPeftModel...`).
    base_folder = os.path.join(args.output_dir, "base")
    if not resume or not os.path.isfile(os.path.join(base_folder, "config.json")):
        from damcha_hf.hub import save_hub_checkpoint

        save_hub_checkpoint(model, base_folder, tokenizer_or_processor=processing, metric_heatmap=False,
                            overwrite=True, model_name=f"damcha-{family.model_type}-lora-base")  # fmt: skip
    lora_config = LoraConfig(
        # CAUSAL_LM lets `AutoPeftModelForCausalLM` load the adapter through transformers' Auto classes (without a
        # task type PEFT would import the model class's own module, which its import allowlist refuses).
        task_type=None if family.vision else "CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(family.lora_target_modules),
        modules_to_save=([] if args.freeze_generator else cross_head_modules(model.config))
        + list(family.task_head_modules),
        fan_in_fan_out=family.lora_fan_in_fan_out,
        bias="none",
    )
    peft_model = get_peft_model(model, lora_config)
    settings = {field: getattr(model.config, field, None) for field in recipe_options.METRIC_FIELDS}  # as built
    settings.update(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, freeze_generator=args.freeze_generator)
    os.makedirs(args.output_dir, exist_ok=True)
    write_json(os.path.join(args.output_dir, run_folder.RUN_SETTINGS_FILE), settings)
    peft_model.print_trainable_parameters()
    trainable = sorted(name for name, parameter in peft_model.named_parameters() if parameter.requires_grad)

    trainer = Trainer(
        model=peft_model,
        args=recipe_options.training_arguments(args, remove_unused_columns=not family.vision),
        train_dataset=train,
        eval_dataset=validation,
        data_collator=collator,
        processing_class=processing,
        **metrics_kwargs,
    )
    run_folder.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, trainable_parameters=trainable)

    adapter = os.path.join(args.output_dir, "adapter")
    base_reference = adapter_base_reference(args.base_model_id, base_folder)
    peft_model.peft_config["default"].base_model_name_or_path = base_reference
    run.writing(adapter)  # written in place by PEFT: named in the run record first
    # The embeddings are frozen and `<output-dir>/base` holds them as trained: no copy in the adapter (PEFT's "auto"
    # would look for the base's config at a Hub id or relative path to decide that, and warn when it cannot).
    peft_model.save_pretrained(adapter, save_embedding_layers=False)
    processing.save_pretrained(adapter)
    card = adapter_card(args, family, trainable, base_reference)
    safe_files.atomic_write(os.path.join(adapter, "README.md"), card)
    check_adapter_has_no_local_paths(adapter, args.output_dir)
    run.wrote(adapter)
    if args.push_to_hub:  # the base first: the adapter names it
        run_folder.push_final_model(
            argparse.Namespace(**{**vars(args), "hub_model_id": args.base_model_id}), base_folder
        )
        run_folder.push_final_model(args, adapter)
    if args.merge:
        merged = peft_model.merge_and_unload()
        run_folder.save_final_model(merged, os.path.join(args.output_dir, "merged"), tokenizer_or_processor=processing,
                                log_history=trainer.state.log_history, datasets=datasets)  # fmt: skip
    if getattr(args, "validation_documents", None) is not None:  # a language model's validation (images: none)
        metrics["eval_documents"] = args.validation_documents
    write_json(os.path.join(args.output_dir, "eval_results.json"), metrics)
    run_folder.print_evaluation(metrics)
    return metrics


ADAPTER_PLACEHOLDER = "path/to/adapter"
BASE_PLACEHOLDER = "path/to/base"


def adapter_base_reference(base_model_id: str | None, base_folder: str) -> str:
    """The adapter's `base_model_name_or_path`: the Hub id the base is published under when given, else the base
    folder relative to the current folder (PEFT resolves a relative path against the folder it is loaded from), or
    `../base` (beside the adapter) when the run folder is outside the current folder. Never an absolute path."""
    if base_model_id:
        return base_model_id
    relative = os.path.relpath(base_folder)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return os.pardir + "/" + os.path.basename(base_folder)
    return relative.replace(os.sep, "/")


def check_adapter_has_no_local_paths(adapter: str, output_dir: str) -> None:
    """Refuse (before anyone pushes it) an adapter folder whose files name the machine's absolute paths."""
    from pathlib import Path

    from damcha_hf.hub.push import check_no_local_paths

    folder = Path(adapter)
    check_no_local_paths(folder, sorted(folder.iterdir()), extra=[Path(output_dir)])


def adapter_card(args, family, trainable: list[str], base_reference: str) -> str:
    """The adapter's README.md (PEFT's own is an empty template): what it holds and how to load it."""
    generator = "frozen" if args.freeze_generator else "trained in full (PEFT `modules_to_save`)"
    base_id = args.base_model_id or BASE_PLACEHOLDER  # the snippets name a published base by its Hub id
    # A pushed adapter is loaded by its Hub id: the push fills the placeholder with the repository as created
    # (`namespace/name`, also for a bare --hub-model-id). A local one is loaded from wherever the reader put it.
    from damcha_hf.hub import REPO_PLACEHOLDER

    adapter_id = REPO_PLACEHOLDER if args.push_to_hub else ADAPTER_PLACEHOLDER
    base_line = [f"base_model: {args.base_model_id}"] if args.base_model_id else []
    lines = [
        "---", "library_name: peft", *base_line, "tags:", "- damcha", "- lora", f"- {family.model_type}", "---", "",
        f"# LoRA adapter for a DAMCHA {family.display_name} model", "",
        f"LoRA (rank {args.lora_rank}, alpha {args.lora_alpha:g}) on `{'`, `'.join(family.lora_target_modules)}`; "
        f"the cross-head modules {generator}; {len(trainable)} trainable tensors. Trained for {args.max_steps} steps "
        "with `recipes/finetune_lora.py` of damcha-hf.", "",
        "## How to load", "",
    ]  # fmt: skip
    where = (
        f"the Hub repository `{base_reference}` (publish `<output-dir>/base` there)"
        if args.base_model_id
        else f"`{base_reference}`, the DAMCHA base model saved beside the adapter (`<output-dir>/base`), as a path "
        + ("relative to the adapter folder" if base_reference.startswith("..") else "relative to the folder "
           "training ran in")
    )  # fmt: skip
    if family.vision:
        lines += [
            "Load the base DAMCHA model (`<output-dir>/base` of the run folder) and attach the adapter:", "",
            "```python", "import damcha_hf  # registers the DAMCHA classes", "from peft import PeftModel",
            "from transformers import AutoModelForImageClassification", "",
            f'base = AutoModelForImageClassification.from_pretrained("{base_id}")',
            f'model = PeftModel.from_pretrained(base, "{adapter_id}")', "```", "",
            f"`base_model_name_or_path` in `adapter_config.json` is {where}.",
        ]  # fmt: skip
        return "\n".join(lines) + "\n"
    lines += [
        "With plain PEFT, in any process (the damcha-hf plugin is not needed: the base checkpoint carries the model "
        "code, which `trust_remote_code=True` lets transformers run; read it first). `base_model_name_or_path` in "
        f"`adapter_config.json` is {where}; `AutoPeftModelForCausalLM` loads the base from there:", "",
        "```python", "from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
        f'model = AutoPeftModelForCausalLM.from_pretrained("{adapter_id}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{adapter_id}", trust_remote_code=True)',
        "merged = model.merge_and_unload()  # a plain DAMCHA model", "```", "",
        "From any other folder, or with the base somewhere else, name the base yourself:", "",
        "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
        f'base = AutoModelForCausalLM.from_pretrained("{base_id}", trust_remote_code=True)',
        f'model = PeftModel.from_pretrained(base, "{adapter_id}")', "```", "",
        "With the plugin installed, `trust_remote_code` is not needed (`import damcha_hf` registers the classes).",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def load_adapter(base: str, adapter: str, **metric_options):
    """The trained PEFT model back from `--base` and `<output-dir>/adapter` (converting a plain base as training did)."""
    import transformers
    from peft import PeftModel
    from transformers import AutoConfig

    import damcha_hf
    from damcha_hf.families import family_for_model_type

    config = AutoConfig.from_pretrained(base)
    family = family_for_model_type(config.model_type)
    head = family.task_head
    if config.model_type == family.model_type:
        model = damcha_hf.convert_to_damcha(head.stock_class.from_pretrained(base), **metric_options)
    else:
        model = getattr(transformers, head.auto_class).from_pretrained(base, **metric_options)
    return PeftModel.from_pretrained(model, adapter)


if __name__ == "__main__":
    recipe_options.run_recipe(main)
