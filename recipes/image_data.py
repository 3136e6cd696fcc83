"""The image recipes' data: image options, Fashion-MNIST or an image folder (the presets), or --dataset-name /
--train-file through `datasets` with --image-column-name and --label-column-name; the ViT image processor, light
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


IMAGE_COLUMN_FLAGS = {"--image-column-name": "image_column_name", "--label-column-name": "label_column_name"}


def add_image_data_arguments(parser: argparse.ArgumentParser, *, labels: bool = True, group=None) -> None:
    """The image data flags: the --data preset (Fashion-MNIST, an image folder), or --dataset-name / --train-file
    through `datasets` with the image column and (a classifier's) label column, as run_image_classification names
    them."""
    group = group or parser.add_argument_group("data")
    group.add_argument("--data", default="fashion-mnist",
                       help="an image folder (<folder>/<label>/<images>) or 'fashion-mnist' (the idx files in "
                       "--fashion-mnist-dir; default); or name data with --dataset-name / --train-file instead")  # fmt: skip
    group.add_argument("--validation-fraction", type=checks.probability, default=0.1,
                       help="the share of the training images held out where the data have no validation split")  # fmt: skip
    columns = {"--image-column-name": ("image", "the column holding the images (decoded by `datasets`)")}
    if labels:
        columns["--label-column-name"] = ("label", "the column holding the class of each image (names or ids)")
    data_sources.add_dataset_arguments(group, task_columns=columns)
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


def check_image_data_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The data flags together (`data_sources.check_dataset_arguments`), then the --data preset (`check_image_data`)
    where it is used."""
    columns = {flag: name for flag, name in IMAGE_COLUMN_FLAGS.items() if hasattr(args, name)}
    data_sources.check_dataset_arguments(parser, args, columns=columns)
    if not data_sources.uses_datasets_flags(args):
        check_image_data(parser, args.data)


def data_label(args: argparse.Namespace) -> str:
    """What the data are called (run folder, model card): --dataset-name, --train-file or --data."""
    return getattr(args, "dataset_name", None) or getattr(args, "train_file", None) or args.data


def check_image_data(parser: argparse.ArgumentParser, data: str) -> None:
    """`--data` of an image recipe is 'fashion-mnist' or an image folder laid out as `load_image_folder` reads it."""
    if data != "fashion-mnist":
        message = data_sources.image_folder_error(data)
        if message:
            parser.error(f"--data {message}, or 'fashion-mnist'")


def image_datasets(args: argparse.Namespace):
    """(DatasetDict with train/validation of `image` + `label`, label names, channels) from the data options."""
    from damcha_hf.data import load_fashion_mnist, load_image_folder

    if data_sources.uses_datasets_flags(args):
        splits = named_image_splits(args)
        image_size = args.image_size or 64
    elif args.data == "fashion-mnist":
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
        splits = load_image_folder(args.data, validation_fraction=args.validation_fraction, seed=args.seed)
        image_size = args.image_size or 64
    if data_sources.uses_datasets_flags(args) or args.data != "fashion-mnist":
        if args.max_train_samples is not None:
            splits["train"] = splits["train"].select(range(min(args.max_train_samples, len(splits["train"]))))
        if args.max_eval_samples is not None:
            splits["validation"] = splits["validation"].select(
                range(min(args.max_eval_samples, len(splits["validation"])))
            )
    labels = splits["train"].features["label"].names
    channels = 1 if splits["train"][0]["image"].mode in ("L", "I", "I;16", "F") else 3
    return splits, labels, channels, image_size


def named_image_splits(args: argparse.Namespace):
    """`train` and `validation` of --dataset-name / --train-file as `image` and `label` columns: the image column
    decoded to PIL images, the labels a `ClassLabel` (names kept; other values, numbers or text, become classes in
    sorted order). Without --label-column-name's column (the denoiser needs none), every image is of class 0."""
    import datasets

    from damcha_hf.data import load_dataset_splits

    label_column = getattr(args, "label_column_name", None)
    columns = {"--image-column-name": args.image_column_name}
    if label_column:
        columns["--label-column-name"] = label_column
    splits = load_dataset_splits(
        dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
        validation_file=args.validation_file, train_split=args.train_split, validation_split=args.validation_split,
        validation_fraction=args.validation_fraction, share_flag=data_sources.held_out_share_flag(args),
        columns=columns,
    )  # fmt: skip
    splits = splits.select_columns(list(dict.fromkeys([args.image_column_name, *filter(None, [label_column])])))
    feature = splits["train"].features[args.image_column_name]
    if not isinstance(feature, datasets.Image):
        if not (isinstance(feature, dict) and "bytes" in feature) and feature != datasets.Value("binary"):
            raise ValueError(f"--image-column-name {args.image_column_name}: the column holds {feature}, not images; "
                             "name the column of images (encoded image bytes, as `datasets` stores an Image column)")  # fmt: skip
        splits = splits.cast_column(args.image_column_name, datasets.Image())
    splits = splits.rename_column(args.image_column_name, "image") if args.image_column_name != "image" else splits
    if not label_column:
        return datasets.DatasetDict({name: rows.add_column("label", [0] * len(rows)).cast_column(
            "label", datasets.ClassLabel(names=["image"])) for name, rows in splits.items()})  # fmt: skip
    splits = splits.rename_column(label_column, "label") if label_column != "label" else splits
    train_feature = splits["train"].features["label"]
    if isinstance(train_feature, datasets.ClassLabel):
        for name, rows in splits.items():
            if rows.features["label"] != train_feature:
                raise ValueError(f"--label-column-name {label_column}: the {name} split's classes "
                                 f"{getattr(rows.features['label'], 'names', rows.features['label'])} differ from "
                                 f"training's {train_feature.names}")  # fmt: skip
        return splits
    for name, rows in splits.items():
        feature = rows.features["label"]
        dtype = getattr(feature, "dtype", "") if isinstance(feature, datasets.Value) else ""
        if not (dtype.startswith(("int", "uint")) or dtype in ("string", "large_string", "bool")):
            raise ValueError(f"--label-column-name {label_column}: the {name} split's column holds {feature}, not one "
                             "class per image; name the column of class names or integer ids")  # fmt: skip
    found = {value for rows in splits.values() for value in rows["label"]}
    if None in found:
        raise ValueError(f"--label-column-name {label_column}: some images have no class (an empty value); give "
                         "each one, or leave those rows out")  # fmt: skip
    values = sorted(found, key=lambda value: (str(type(value)), value))
    names = [str(value) for value in values]
    index = {value: position for position, value in enumerate(values)}
    label_feature = datasets.ClassLabel(names=names)
    return datasets.DatasetDict({
        # Only the label column goes through the map: the images are not decoded for it.
        name: rows.map(lambda label: {"label": index[label]}, input_columns="label").cast_column("label", label_feature)
        for name, rows in splits.items()
    })  # fmt: skip


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
