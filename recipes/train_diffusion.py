#!/usr/bin/env python
"""Train a DAMCHA ViT denoiser (a diffusion model) with the transformers `Trainer` and diffusers' noise schedules.

    python recipes/train_diffusion.py                                    # Fashion-MNIST idx files, 28x28, patch 4
    python recipes/train_diffusion.py --max-steps 5                      # a quick check
    python recipes/train_diffusion.py --cross-head-variant none          # the multi-head attention baseline
    python recipes/train_diffusion.py --data path/to/images --image-size 32 --patch-size 2
    python recipes/train_diffusion.py --feature-classifier runs/vit-none-fashion-mnist/final   # adds the FCD
    python recipes/train_diffusion.py --resume                           # continue the latest checkpoint

Data as in `train_vit.py`: the --data presets (Fashion-MNIST, an image folder), or `--dataset-name` / `--train-file`
through `datasets` with `--image-column-name` (a denoiser needs no labels).

Training noises each image at a uniformly drawn step of diffusers' `DDPMScheduler` and regresses the noise (mean
squared error). Every checkpoint folder gets `sample_grid.png`: DDIM samples from the same start noise every time (so
grids of one run, and of runs with other attention, compare image by image). At the end the recipe reports the
denoising error on held-out images per timestep range and, given `--feature-classifier` (a ViT image classifier
trained on the same data, e.g. by train_vit.py), the Fréchet classifier distance (FCD) between samples and held-out
images: FID's formula on that classifier's features, so not comparable with FID values (docs/diffusion.md).

The model, its image processor, `scheduler_config.json` (load it with diffusers' `DDIMScheduler.from_pretrained`), a
sample grid and a model card go to `<output-dir>/final`. Needs diffusers: `pip install damcha-hf[diffusion]`.

On `--resume`, the checkpoint's model and schedule settings win: a flag left out takes the checkpoint's value, one
given with a different value is refused (naming every such flag).
"""

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import image_data  # standard library only: torch, transformers and diffusers are imported after the arguments are parsed
import recipe_options
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources
from damcha_hf.safe_files import atomic_files, checkpoint_checks

SCHEDULE_FLAGS = {"num_train_timesteps": "num_train_timesteps", "beta_schedule": "beta_schedule"}
BETA_SCHEDULES = ("linear", "squaredcos_cap_v2")
SCHEDULER_CONFIG = "scheduler_config.json"  # diffusers' file name: DDIMScheduler.from_pretrained(folder) reads it
SAMPLE_GRID = "sample_grid.png"
# The start noise of the sample grids and the noise of the held-out evaluation: the same for every run, so that runs
# with other attention or seeds are compared on identical inputs.
EVALUATION_SEED = 20260
QUICK_SAMPLE_STEPS, QUICK_NUM_SAMPLES = 10, 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    image_data.add_image_data_arguments(parser, labels=False)
    # Random crops would teach the model the crops' reflected borders: a denoiser is augmented by flips only.
    parser._option_string_actions["--no-augment"].help = "no random left-right flips of training images"
    image_data.add_vit_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this denoiser checkpoint folder instead of a new model (its "
                        "size; the --cross-head-variant and variant flags given apply to an MHA checkpoint, "
                        "cross_head_variant none, each variant starting as its function, and are refused on another "
                        "one)")  # fmt: skip
    recipe_options.add_metric_arguments(parser)
    group = parser.add_argument_group("diffusion")
    group.add_argument("--num-train-timesteps", type=checks.positive_int, default=1000,
                       help="steps of the DDPM noise schedule")  # fmt: skip
    group.add_argument("--beta-schedule", choices=BETA_SCHEDULES, default="linear",
                       help="linear (DDPM's betas, 1e-4 to 0.02) or squaredcos_cap_v2 (the cosine schedule)")  # fmt: skip
    group.add_argument("--sample-steps", type=checks.positive_int,
                       help=f"DDIM steps per sample, for the grids and the FCD (default: 50; {QUICK_SAMPLE_STEPS} in a "
                       f"quick run, under {recipe_options.QUICK_RUN_STEPS} steps)")  # fmt: skip
    group.add_argument(
        "--num-samples",
        type=checks.positive_int,
        help=f"images in each sample grid (default: 64; {QUICK_NUM_SAMPLES} in a quick run)",
    )
    group.add_argument("--feature-classifier",
                       help="a ViT image classifier checkpoint folder trained on the same data (e.g. train_vit.py's "
                       "final folder): report the Fréchet classifier distance in its feature space")  # fmt: skip
    group.add_argument("--fcd-samples", type=checks.positive_int, default=1000,
                       help="generated and held-out images the FCD compares (at most the held-out images: see "
                       "--max-eval-samples)")  # fmt: skip
    recipe_options.add_training_arguments(parser, output_dir="runs/diffusion-{settings}", batch_size=64, learning_rate=5e-4,
                                          max_steps=4000, max_eval_samples=1000,
                                          output_dir_example="runs/diffusion-fashion-mnist")  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=lambda args: recipe_options.run_folder_name(
        args.cross_head_variant, args.metric_context, image_data.data_label(args)))  # fmt: skip
    if importlib.util.find_spec("diffusers") is None:
        parser.error("diffusers is not installed (its DDPM and DDIM schedulers drive the training and sampling); "
                     "install it with `pip install damcha-hf[diffusion]`")  # fmt: skip
    quick = args.max_steps < recipe_options.QUICK_RUN_STEPS  # a smoke test: small grids, few sampling steps
    args.sample_steps = args.sample_steps or (QUICK_SAMPLE_STEPS if quick else 50)
    args.num_samples = args.num_samples or (QUICK_NUM_SAMPLES if quick else 64)
    if not args.init_from:  # a new model: its size flags must fit together
        checks.check_heads_divide_width(parser, args.hidden_size, args.num_heads, width_flag="--hidden-size",
                                        heads_flag="--num-heads")  # fmt: skip
    image_data.check_image_data_arguments(parser, args)
    preset = not data_sources.uses_datasets_flags(args)
    if preset and args.data == "fashion-mnist" and not os.path.isdir(args.fashion_mnist_dir):
        parser.error(f"--fashion-mnist-dir {args.fashion_mnist_dir} does not exist: on Debian/Ubuntu `apt-get install "
                     "dataset-fashion-mnist` puts the idx files in /usr/share/datasets/fashion-mnist; or pass the "
                     "folder that holds them, or --data an image folder")  # fmt: skip
    image_size = args.image_size or (28 if preset and args.data == "fashion-mnist" else 64)
    if not args.init_from and image_size % args.patch_size:
        parser.error(f"--patch-size {args.patch_size} must divide the image size ({image_size}); pick a divisor, "
                     "or set --image-size to a multiple of it")  # fmt: skip
    recipe_options.check_vit_init_and_variant_flags(parser, args)
    if args.feature_classifier:
        check_feature_classifier(parser, args.feature_classifier, image_size)
    return args


# The model types and heads a --feature-classifier checkpoint may hold: a ViT (stock or DAMCHA) image classifier.
CLASSIFIER_MODEL_TYPES = ("vit", "damcha_vit")
CLASSIFIER_HEAD = "ForImageClassification"


def check_feature_classifier(parser: argparse.ArgumentParser, folder: str, image_size: int) -> None:
    """--feature-classifier is a ViT image classifier checkpoint of the run's image size, read from its config.json
    while parsing (the channels are checked once the data are read)."""
    fix = "it must be a ViT image classifier checkpoint, e.g. recipes/train_vit.py's final folder"
    if not os.path.isdir(folder):
        parser.error(f"--feature-classifier {folder}: no such checkpoint folder; {fix}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        parser.error(f"--feature-classifier {folder} is not a checkpoint folder (no config.json); {fix}")
    checks.check_output(parser, checkpoint_checks.check_checkpoint_files, folder)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)  # a JSON object: check_checkpoint_files read it
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    holds = f"a {model_type!r} model" + (f" ({', '.join(map(str, architectures))})" if architectures else "")
    if model_type not in CLASSIFIER_MODEL_TYPES:
        parser.error(f"--feature-classifier {folder} holds {holds}; {fix}")
    if not any(str(name).endswith(CLASSIFIER_HEAD) for name in architectures):
        parser.error(f"--feature-classifier {folder} holds {holds}, no image-classification head; {fix}")
    classifier_size = config.get("image_size", 224)  # ViTConfig's default
    if classifier_size not in (image_size, [image_size, image_size]):
        parser.error(f"--feature-classifier {folder} takes {classifier_size}-pixel images but the data here are "
                     f"{image_size}-pixel; train the classifier on the same data and --image-size")  # fmt: skip


def build_model(args, channels: int, image_size: int):
    from transformers import AutoModel

    import damcha_hf

    if args.init_from:
        with checkpoint_checks.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            model = AutoModel.from_pretrained(args.init_from, attn_implementation=args.attn,
                                              **recipe_options.metric_options(args))  # fmt: skip
        if not isinstance(model, damcha_hf.DamchaViTDenoiserModel):
            raise ValueError(f"--init-from {args.init_from} holds a {type(model).__name__}, not a ViT denoiser; pass a "
                             "checkpoint of this recipe")  # fmt: skip
        if (model.config.num_channels, model.config.image_size) != (channels, image_size):
            raise ValueError(f"--init-from {args.init_from} takes {model.config.num_channels}-channel "
                             f"{model.config.image_size}-pixel images but the data here are {channels}-channel "
                             f"{image_size}-pixel; pass --image-size {model.config.image_size} or another checkpoint")  # fmt: skip
        return model
    config = damcha_hf.DamchaViTDenoiserConfig(**image_data.vit_config_options(args, channels, image_size))
    config._attn_implementation = args.attn
    return AutoModel.from_config(config)


class NoisingCollator:
    """A batch of processed images -> the denoiser's inputs: noised images, their timesteps, and the noise as labels
    (random left-right flips first, unless `augment` is off). Draws from torch's global generator, which the
    `Trainer` seeds and checkpoints."""

    def __init__(self, scheduler, augment: bool):
        self.scheduler, self.augment = scheduler, augment

    def __call__(self, examples):
        import torch

        from damcha_hf.diffusion import noised_batch

        images = torch.stack([example["pixel_values"] for example in examples])
        if self.augment:
            flip = torch.rand(len(images)) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        noisy, noise, timesteps = noised_batch(self.scheduler, images)
        return {"pixel_values": noisy, "timestep": timesteps, "labels": noise}


def evaluation_generator():
    import torch

    return torch.Generator().manual_seed(EVALUATION_SEED)


def sample_grid_callback(scheduler, args):
    """A `TrainerCallback` that writes each checkpoint's `sample_grid.png` and `scheduler_config.json`."""
    from transformers import TrainerCallback

    from damcha_hf.diffusion import sample_images, save_image_grid

    class SampleGrid(TrainerCallback):
        def on_save(self, training_args, state, control, model=None, **kwargs):
            if not state.is_world_process_zero:
                return
            checkpoint = os.path.join(training_args.output_dir, f"checkpoint-{state.global_step}")
            if not os.path.isdir(checkpoint):
                return
            samples = sample_images(model, scheduler, args.num_samples, num_inference_steps=args.sample_steps,
                                    generator=evaluation_generator(), batch_size=args.batch_size)  # fmt: skip
            save_image_grid(samples, os.path.join(checkpoint, SAMPLE_GRID))
            atomic_files.atomic_write(os.path.join(checkpoint, SCHEDULER_CONFIG), scheduler_json(scheduler))
            print(f"step {state.global_step}: samples in {os.path.join(checkpoint, SAMPLE_GRID)}", flush=True)

    return SampleGrid()


def scheduler_json(scheduler) -> str:
    return json.dumps({key: value for key, value in scheduler.config.items() if not key.startswith("_")}, indent=2)


def saved_schedule(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, SCHEDULER_CONFIG)
    return checkpoint_checks.read_json_file(path, "a scheduler config") if os.path.isfile(path) else {}


def load_feature_classifier(args, channels: int, image_size: int):
    from transformers import AutoModelForImageClassification

    with checkpoint_checks.loading_checkpoint(args.feature_classifier, "the --feature-classifier checkpoint"):
        classifier = AutoModelForImageClassification.from_pretrained(args.feature_classifier)
    config = classifier.config
    if getattr(config, "num_channels", None) != channels or getattr(config, "image_size", None) != image_size:
        raise ValueError(
            f"--feature-classifier {args.feature_classifier} takes {getattr(config, 'num_channels', '?')}-channel "
            f"{getattr(config, 'image_size', '?')}-pixel images but the data here are {channels}-channel "
            f"{image_size}-pixel; train the classifier on the same data and --image-size"
        )
    if not hasattr(classifier, "base_model") or not hasattr(classifier.base_model, "embeddings"):
        raise ValueError(f"--feature-classifier {args.feature_classifier}: not a ViT image classifier; train one with "
                         "recipes/train_vit.py")  # fmt: skip
    return classifier


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    if resume:
        run_folder.check_resume_settings(
            args, resume, image_data.VIT_MODEL_FLAGS, run_folder.saved_model_config(resume)
        )
        run_folder.check_resume_settings(args, resume, SCHEDULE_FLAGS, saved_schedule(resume))
    datasets = run_folder.card_datasets(image_data.data_label(args))  # what the card will say, settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    import torch
    from transformers import AutoModel, Trainer, set_seed

    from damcha_hf import diffusion

    set_seed(args.seed)
    splits, _, channels, image_size = image_data.image_datasets(args)
    processor = image_data.image_processor(image_size, channels)
    image_data.attach_image_transforms(splits, processor, augment=False, image_size=image_size)
    classifier = load_feature_classifier(args, channels, image_size) if args.feature_classifier else None
    scheduler = diffusion.training_scheduler(args.num_train_timesteps, args.beta_schedule)
    model = build_model(args, channels, image_size)
    if resume:
        model = run_folder.load_resumed_weights(AutoModel, resume, args.attn)
    print(f"{type(model).__name__} ({model.config.cross_head_variant}): {model.num_parameters():,} parameters; "
          f"{len(splits['train'])} training and {len(splits['validation'])} held-out images")  # fmt: skip

    trainer = Trainer(
        model=model,
        args=recipe_options.training_arguments(args, remove_unused_columns=False, prediction_loss_only=True),
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
        data_collator=NoisingCollator(scheduler, augment=not args.no_augment),
        processing_class=processor,
        callbacks=[sample_grid_callback(scheduler, args)],
    )
    train_result = run_folder.train(trainer, run, load_state)

    model = trainer.model
    held_out = torch.stack([example["pixel_values"] for example in splits["validation"]])
    metrics = {f"eval_{key}": value for key, value in diffusion.denoising_mse_by_timestep_range(
        model, scheduler, held_out, generator=evaluation_generator(), batch_size=args.batch_size).items()}  # fmt: skip
    samples = diffusion.sample_images(model, scheduler, max(args.num_samples, args.fcd_samples if classifier else 0),
                                      num_inference_steps=args.sample_steps, generator=evaluation_generator(),
                                      batch_size=args.batch_size)  # fmt: skip
    if classifier is not None:
        count = min(args.fcd_samples, len(held_out))
        metrics["eval_fcd"] = diffusion.frechet_classifier_distance(classifier, samples[:count], held_out[:count])
        metrics["eval_fcd_samples"] = count
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss,
                   sample_steps=args.sample_steps)  # fmt: skip
    run_folder.print_evaluation(metrics)

    final = os.path.join(args.output_dir, "final")
    noisy, _, timesteps = diffusion.noised_batch(scheduler, held_out[:4], evaluation_generator())
    grid = diffusion.image_grid_png(samples[: args.num_samples])
    card = {"datasets": datasets, "heatmap_inputs": {"pixel_values": noisy, "timestep": timesteps},
            "heatmap_description": "the first 4 held-out images of the training run, noised at random timesteps",
            "eval_results": {key.removeprefix("eval_"): value for key, value in metrics.items()
                             if key.startswith("eval_mse") or key == "eval_fcd"},
            "extra_files": {SCHEDULER_CONFIG: scheduler_json(scheduler)}, "sample_grid": grid,
            "sample_grid_description": f"{args.num_samples} images sampled with DDIM in {args.sample_steps} steps "
            f"(eta = 0) on the training noise schedule ({args.num_train_timesteps} steps, {args.beta_schedule} "
            "betas), from fixed start noise."}  # fmt: skip
    run_folder.save_final_model(model, final, tokenizer_or_processor=processor, log_history=trainer.state.log_history,
                                **card)  # fmt: skip
    run_folder.finish_run(args, final, metrics, saved_note=f" (samples: {os.path.join(final, SAMPLE_GRID)})")
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
