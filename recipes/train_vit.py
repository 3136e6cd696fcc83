#!/usr/bin/env python
"""Train a DAMCHA ViT image classifier with the transformers `Trainer`; accuracy through the shipped evaluate module.

    python recipes/train_vit.py                                     # Fashion-MNIST idx files, 28x28, patch 4
    python recipes/train_vit.py --data path/to/images --image-size 64 --patch-size 8
    python recipes/train_vit.py --metric-context token --attn eager --max-steps 200
    python recipes/train_vit.py --resume                            # continue the latest checkpoint of runs/vit-fashion-mnist

An image folder is laid out as `<folder>/<label>/<image>` (or with `train/` and `validation/` inside). Images go
through `ViTImageProcessor` and, for training, a random reflect-padded crop and a left-right flip (torch ops). The
model and its image processor are saved to `<output-dir>/final` with a model card (`damcha_hf.hub`).

On `--resume`, the checkpoint's model settings win: a model flag left out takes the checkpoint's value, one given with
a different value is refused (naming every such flag).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import image_data  # standard library only: torch and transformers are imported after the arguments are parsed
import recipe_options
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import checkpoint_checks


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    image_data.add_image_data_arguments(parser)
    image_data.add_vit_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this checkpoint folder instead of a new model")
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/vit-{settings}", batch_size=64, learning_rate=1e-3,
                                          max_steps=2000, max_eval_samples=2000,
                                          output_dir_example="runs/vit-fashion-mnist")  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=lambda args: recipe_options.run_folder_name(
        args.cross_head_variant, args.metric_context, args.data))  # fmt: skip
    if not args.init_from:
        checks.check_heads_divide_width(parser, args.hidden_size, args.num_heads, width_flag="--hidden-size",
                                        heads_flag="--num-heads")  # fmt: skip
    if args.init_from and not os.path.isdir(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such checkpoint folder")
    if args.init_from:  # a damaged file is named now, before any data is read
        checks.check_output(parser, checkpoint_checks.check_checkpoint_files, args.init_from)
    image_data.check_image_data(parser, args.data)
    if args.data == "fashion-mnist" and not os.path.isdir(args.fashion_mnist_dir):
        parser.error(f"--fashion-mnist-dir {args.fashion_mnist_dir} does not exist: on Debian/Ubuntu `apt-get install "
                     "dataset-fashion-mnist` puts the idx files in /usr/share/datasets/fashion-mnist; or pass the "
                     "folder that holds them, or --data an image folder")  # fmt: skip
    return args


def build_model(args, labels, channels, image_size):
    from transformers import AutoModelForImageClassification

    import damcha_hf

    label_maps = {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)}}
    if args.init_from:
        with checkpoint_checks.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            return AutoModelForImageClassification.from_pretrained(
                args.init_from, num_labels=len(labels), ignore_mismatched_sizes=True, attn_implementation=args.attn,
                **label_maps,
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
    datasets = run_folder.card_datasets(args.data)  # what the card will say, settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import AutoModelForImageClassification, Trainer, set_seed

    from damcha_hf.metrics import accuracy_compute_metrics

    set_seed(args.seed)
    splits, labels, channels, image_size = image_data.image_datasets(args)
    processor = image_data.image_processor(image_size, channels)
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
            "eval_results": {"accuracy": metrics["eval_accuracy"]}}  # fmt: skip
    run_folder.save_final_model(trainer.model, final, tokenizer_or_processor=processor,
                                log_history=trainer.state.log_history, **card)  # fmt: skip
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
