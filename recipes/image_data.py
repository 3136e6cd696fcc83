"""The image recipes' data: image options, Fashion-MNIST or an image folder, the ViT image processor, light
augmentation, `set_transform` and collate; and the size options of a new ViT."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

import recipe_options

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources

if TYPE_CHECKING:
    import torch


def add_image_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data", default="fashion-mnist",
                       help="an image folder (<folder>/<label>/<images>) or 'fashion-mnist' (the idx files in "
                       "--fashion-mnist-dir; default)")  # fmt: skip
    group.add_argument("--fashion-mnist-dir", default="/usr/share/datasets/fashion-mnist")
    group.add_argument("--image-size", type=checks.positive_int, default=None, help="resize to this (default: 28 for Fashion-MNIST, "
                       "else 64)")  # fmt: skip
    group.add_argument("--no-augment", action="store_true", help="no random crop / flip of training images")


# The ViT size flags of a new model and the config fields they set (checked against the checkpoint on --resume).
VIT_MODEL_FLAGS = {"patch_size": "patch_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                   "num_heads": "num_attention_heads", **{field: field for field in recipe_options.METRIC_FIELDS}}  # fmt: skip


def add_vit_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The size of a new ViT (classifier or denoiser): patch, width, depth, heads, MLP ratio, dropout."""
    group = parser.add_argument_group("model size (new models)")
    group.add_argument("--patch-size", type=checks.positive_int, default=4)
    group.add_argument("--hidden-size", type=checks.positive_int, default=192)
    group.add_argument("--num-layers", type=checks.positive_int, default=6)
    group.add_argument("--num-heads", type=checks.positive_int, default=6, help="must divide --hidden-size")
    group.add_argument("--mlp-ratio", type=checks.positive_int, default=4)
    group.add_argument("--dropout", type=checks.probability, default=0.0)


def vit_config_options(args: argparse.Namespace, channels: int, image_size: int) -> dict:
    """The ViT config fields of the size and metric flags (`add_vit_size_arguments`, `add_metric_arguments`)."""
    return {
        "image_size": image_size,
        "patch_size": args.patch_size,
        "num_channels": channels,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "intermediate_size": args.mlp_ratio * args.hidden_size,
        "hidden_dropout_prob": args.dropout,
        "attention_probs_dropout_prob": args.dropout,
        **recipe_options.metric_options(args),
    }


def check_image_data(parser: argparse.ArgumentParser, data: str) -> None:
    """`--data` of an image recipe is 'fashion-mnist' or an image folder laid out as `load_image_folder` reads it."""
    if data != "fashion-mnist":
        message = data_sources.image_folder_error(data)
        if message:
            parser.error(f"--data {message}, or 'fashion-mnist'")


def image_datasets(args: argparse.Namespace):
    """(DatasetDict with train/validation of `image` + `label`, label names, channels) from the data options."""
    from damcha_hf.data import load_fashion_mnist, load_image_folder

    if args.data == "fashion-mnist":
        train_images = args.max_train_samples
        if train_images is None:  # only what the run needs, as the text recipes read only the text they need
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            train_images = 2 * args.max_steps * args.batch_size * args.gradient_accumulation_steps * world_size
            print(f"reading at most {train_images:,} Fashion-MNIST training images (twice what {args.max_steps} steps "
                  "need; --max-train-samples sets it)", flush=True)  # fmt: skip
        train = load_fashion_mnist(args.fashion_mnist_dir, "train", max_samples=train_images)
        validation = load_fashion_mnist(args.fashion_mnist_dir, "test", max_samples=args.max_eval_samples)
        import datasets

        splits = datasets.DatasetDict(train=train, validation=validation)
        image_size = args.image_size or 28
    else:
        splits = load_image_folder(args.data, seed=args.seed)
        if args.max_train_samples is not None:
            splits["train"] = splits["train"].select(range(min(args.max_train_samples, len(splits["train"]))))
        if args.max_eval_samples is not None:
            splits["validation"] = splits["validation"].select(
                range(min(args.max_eval_samples, len(splits["validation"])))
            )
        image_size = args.image_size or 64
    labels = splits["train"].features["label"].names
    channels = 1 if splits["train"][0]["image"].mode in ("L", "I", "I;16", "F") else 3
    return splits, labels, channels, image_size


def image_processor(image_size: int, channels: int):
    """The ViT image processor: the torchvision backend where torchvision is installed, else the PIL one, by name
    (transformers falls back to it too, with a warning in every run). Both save as `ViTImageProcessor`."""
    import transformers
    from transformers.utils import is_torchvision_available

    # By name: even looking up `ViTImageProcessor` without torchvision gives the warning.
    processor_class = "ViTImageProcessor" if is_torchvision_available() else "ViTImageProcessorPil"
    return getattr(transformers, processor_class)(
        size={"height": image_size, "width": image_size},
        image_mean=[0.5] * channels,
        image_std=[0.5] * channels,
        do_convert_rgb=channels == 3,
    )


def random_crop_and_flip(pixel_values: torch.Tensor, padding: int, generator: torch.Generator | None = None):
    """Light augmentation with torch ops only (no torchvision): reflect-pad by `padding`, crop back to the original
    size at a random offset, and flip left-right with probability 1/2. `pixel_values`: (channels, height, width)."""
    import torch

    _, height, width = pixel_values.shape
    if padding > 0:
        padded = torch.nn.functional.pad(pixel_values[None], (padding,) * 4, mode="reflect")[0]
        top, left = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist()
        pixel_values = padded[:, top : top + height, left : left + width]
    if torch.rand((), generator=generator) < 0.5:
        pixel_values = pixel_values.flip(-1)
    return pixel_values


def attach_image_transforms(splits, processor, *, augment: bool, image_size: int) -> None:
    """Process images on the fly (`set_transform`): `pixel_values` from the processor, augmented for training."""
    padding = max(1, image_size // 8)

    import torch

    def transform(batch, train: bool):
        pixel_values = processor(batch["image"], return_tensors="pt")["pixel_values"]
        if train and augment:
            pixel_values = torch.stack([random_crop_and_flip(p, padding) for p in pixel_values])
        return {"pixel_values": pixel_values, "labels": batch["label"]}

    splits["train"].set_transform(lambda batch: transform(batch, True))
    splits["validation"].set_transform(lambda batch: transform(batch, False))


def image_collate(examples):
    import torch

    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }
