#!/usr/bin/env python
"""Train a DAMCHA ViT image classifier with the transformers `Trainer`; accuracy through the shipped evaluate module.

    python recipes/train_vit.py                                     # Fashion-MNIST idx files, 28x28, patch 4
    python recipes/train_vit.py --data path/to/images --image-size 64 --patch-size 8
    python recipes/train_vit.py --metric-context token --attn eager --max-steps 200
    python recipes/train_vit.py --resume                            # continue the latest checkpoint of runs/vit-fashion-mnist
    python recipes/train_vit.py --model-name-or-path google/vit-base-patch16-224 --data path/to/images   # fine-tune

    python recipes/train_vit.py --train-file images.parquet --image-column-name img --label-column-name kind
    python recipes/train_vit.py --dataset-name path/to/saved_dataset --validation-split test

Data, as transformers' run_image_classification.py takes it: `--dataset-name` (a Hub id, a local dataset folder, an
image folder or a `save_to_disk` folder; `--dataset-config-name`, `--train-split`, `--validation-split`) or
`--train-file` / `--validation-file` (json/jsonl, csv or parquet, by extension), with `--image-column-name` and
`--label-column-name`; without a validation split or file, `--validation-split-percentage` of the images is held out.
The presets (`--data`) are Fashion-MNIST and an image folder, laid out as `<folder>/<label>/<image>` (or with
`train/` and `validation/` inside). Images go
through `ViTImageProcessor` and, for training, a random reflect-padded crop and a left-right flip (torch ops). The
model and its image processor are saved to `<output-dir>/final` with a model card (`damcha_hf.hub`).

`--model-name-or-path` (a Hub id or a local folder) starts from a pretrained ViT: a
stock checkpoint is converted to DAMCHA with every weight kept (its outputs unchanged before the first step), a DAMCHA
checkpoint is fine-tuned as it is; its image processor and image size are used, and a classifier with other labels
than the data's is replaced by a new one.

On `--resume`, the checkpoint's model settings win: a model flag left out takes the checkpoint's value, one given with
a different value is refused (naming every such flag).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import image_data  # standard library only: torch and transformers are imported after the arguments are parsed
import pretrained_model
import recipe_options
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources
from damcha_hf.safe_files import checkpoint_checks


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    image_data.add_image_data_arguments(parser)
    image_data.add_vit_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this checkpoint folder instead of a new model (its size; the "
                        "--cross-head-variant and variant flags given apply to an MHA checkpoint, cross_head_variant "
                        "none, each variant starting as its function, and are refused on another one)")  # fmt: skip
    pretrained_model.add_pretrained_argument(parser, "ViT")
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/vit-{settings}", batch_size=64, learning_rate=1e-3,
                                          max_steps=2000, max_eval_samples=2000,
                                          output_dir_example="runs/vit-fashion-mnist")  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=lambda args: recipe_options.run_folder_name(
        args.cross_head_variant, args.metric_context, image_data.data_label(args)))  # fmt: skip
    if not args.model_name_or_path and not args.init_from:
        checks.check_heads_divide_width(parser, args.hidden_size, args.num_heads, width_flag="--hidden-size",
                                        heads_flag="--num-heads")  # fmt: skip
    # A pretrained checkpoint's variant flags are checked with it (`check_pretrained`).
    recipe_options.check_vit_init_and_variant_flags(parser, args, variant_flags=not args.model_name_or_path)
    pretrained_model.check_pretrained(parser, args, pretrained_model.IMAGE_CLASSIFICATION,
                                      new_model_flags=NEW_MODEL_FLAGS)  # fmt: skip
    if args.model_name_or_path:
        saved_size = args.pretrained_config.get("image_size")
        if args.image_size is not None and saved_size is not None and args.image_size != saved_size:
            parser.error(f"--image-size {args.image_size}: the --model-name-or-path checkpoint takes {saved_size}-pixel "
                         "images (its position embeddings are learned at that size); leave --image-size out")  # fmt: skip
        args.image_size = args.image_size or saved_size
    image_data.check_image_data_arguments(parser, args)
    preset = not data_sources.uses_datasets_flags(args)
    if preset and args.data == "fashion-mnist" and not os.path.isdir(args.fashion_mnist_dir):
        parser.error(f"--fashion-mnist-dir {args.fashion_mnist_dir} does not exist: on Debian/Ubuntu `apt-get install "
                     "dataset-fashion-mnist` puts the idx files in /usr/share/datasets/fashion-mnist; or pass the "
                     "folder that holds them, or --data an image folder")  # fmt: skip
    return args


# The flags that shape a new model: a pretrained checkpoint brings its own shape.
NEW_MODEL_FLAGS = ("patch_size", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "dropout")


def build_model(args, labels, channels, image_size):
    from transformers import AutoModelForImageClassification

    import damcha_hf

    label_maps = {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)}}
    if args.model_name_or_path:
        saved_channels = args.pretrained_config.get("num_channels", channels)
        if saved_channels != channels:
            raise ValueError(f"--data has {channels}-channel images but the --model-name-or-path checkpoint takes "
                             f"{saved_channels}-channel ones; give images with {saved_channels} channels")  # fmt: skip
        # A classifier for other labels is replaced by a new one (transformers' `ignore_mismatched_sizes`).
        return pretrained_model.load_pretrained_model(
            args, num_labels=len(labels), ignore_mismatched_sizes=True, **label_maps
        )
    if args.init_from:
        with checkpoint_checks.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            return AutoModelForImageClassification.from_pretrained(
                args.init_from, num_labels=len(labels), ignore_mismatched_sizes=True, attn_implementation=args.attn,
                **label_maps, **recipe_options.metric_options(args),
            )  # fmt: skip
    config = damcha_hf.DamchaViTConfig(
        **image_data.vit_config_options(args, channels, image_size), num_labels=len(labels), **label_maps
    )
    config._attn_implementation = args.attn
    return AutoModelForImageClassification.from_config(config)


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    if resume:
        run_folder.check_resume_settings(
            args, resume, image_data.VIT_MODEL_FLAGS, run_folder.saved_model_config(resume)
        )
    datasets = run_folder.card_datasets(image_data.data_label(args))  # what the card will say, settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import AutoModelForImageClassification, Trainer, set_seed

    from damcha_hf.metrics import accuracy_compute_metrics

    set_seed(args.seed)
    splits, labels, channels, image_size = image_data.image_datasets(args)
    processor = None
    if args.model_name_or_path:
        processor = pretrained_model.load_pretrained_image_processor(args)  # None: a folder without one
    processor = processor or image_data.image_processor(image_size, channels)
    image_data.attach_image_transforms(splits, processor, augment=not args.no_augment, image_size=image_size)
    model = build_model(args, labels, channels, image_size)
    if resume:
        model = run_folder.load_resumed_weights(AutoModelForImageClassification, resume, args.attn)
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {len(splits['train'])} training and "
          f"{len(splits['validation'])} validation images, {len(labels)} classes")  # fmt: skip

    trainer = Trainer(
        model=model,
        args=recipe_options.training_arguments(args, remove_unused_columns=False),
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
        data_collator=image_data.image_collate,
        processing_class=processor,
        compute_metrics=accuracy_compute_metrics(),
    )
    train_result = run_folder.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss)
    run_folder.print_evaluation(metrics)
    final = os.path.join(args.output_dir, "final")
    sample = image_data.image_collate([splits["validation"][i] for i in range(min(4, len(splits["validation"])))])
    card = {"datasets": datasets, "heatmap_inputs": {"pixel_values": sample["pixel_values"]},
            "heatmap_description": f"the first {len(sample['pixel_values'])} validation images of the training run",
            "eval_results": {"accuracy": metrics["eval_accuracy"]},
            "base_model": pretrained_model.card_base_model(args)}  # fmt: skip
    run_folder.save_final_model(trainer.model, final, tokenizer_or_processor=processor,
                                log_history=trainer.state.log_history, **card)  # fmt: skip
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
