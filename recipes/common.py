"""Code shared by the recipes in this folder: command-line options, model configs, resuming and saving.

Copy this file along with the recipe you copy. Data loading lives in `damcha_hf.data`, metrics in `damcha_hf.metrics`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

import damcha_hf
from damcha_hf.modeling.damcha_options import METRIC_CONTEXTS, METRIC_MASKS, METRIC_SHARINGS

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def config_has_field(config_class, field: str) -> bool:
    """Whether the config class declares `field` (e.g. `cross_head_variant`, which only some versions have)."""
    return hasattr(config_class, field) or field in getattr(config_class, "__annotations__", {})


def add_metric_arguments(parser: argparse.ArgumentParser, config_class) -> None:
    """Every metric option of a DAMCHA config, as `--metric-*` flags (defaults: the config's own)."""
    group = parser.add_argument_group("DAMCHA metric (defaults: the config's)")
    group.add_argument("--metric-context", choices=METRIC_CONTEXTS, help="what the cross-head matrix C depends on")
    group.add_argument("--metric-mask", choices=METRIC_MASKS, help="the paper's ablation: full, diagonal, offdiagonal")
    group.add_argument("--metric-sharing", choices=METRIC_SHARINGS, help="one generator per stack or per layer")
    group.add_argument("--metric-hidden-size", type=int, help="hidden width r of the metric generator MLP")
    if config_has_field(config_class, "cross_head_variant"):
        group.add_argument(
            "--cross-head-variant",
            help="attention variant: damcha, talking_heads, dcmha, or none (plain multi-head attention)",
        )
    group.add_argument(
        "--attn", choices=ATTENTION_IMPLEMENTATIONS, default="sdpa", help="attention implementation (default: sdpa)"
    )


def metric_options(args: argparse.Namespace) -> dict:
    """The metric fields set on the command line, as config keyword arguments."""
    fields = ("metric_context", "metric_mask", "metric_sharing", "metric_hidden_size", "cross_head_variant")
    return {field: getattr(args, field) for field in fields if getattr(args, field, None) is not None}


def add_training_arguments(
    parser: argparse.ArgumentParser, *, output_dir: str, batch_size: int, learning_rate: float, max_steps: int
) -> None:
    group = parser.add_argument_group("training")
    group.add_argument(
        "--output-dir", default=output_dir, help=f"checkpoints and the final model (default: {output_dir})"
    )
    group.add_argument("--max-steps", type=int, default=max_steps, help=f"optimizer steps (default: {max_steps})")
    group.add_argument("--max-train-samples", type=int, help="use only this many training examples (blocks/images)")
    group.add_argument("--max-eval-samples", type=int, default=256, help="evaluate on at most this many (default: 256)")
    group.add_argument("--batch-size", type=int, default=batch_size, help=f"per device (default: {batch_size})")
    group.add_argument("--gradient-accumulation-steps", type=int, default=1)
    group.add_argument("--learning-rate", type=float, default=learning_rate, help=f"peak (default: {learning_rate})")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: 5%% of max steps)")
    group.add_argument("--logging-steps", type=int, default=10)
    group.add_argument("--eval-steps", type=int, default=None, help="evaluate every N steps (default: 4 times a run)")
    group.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (default: = eval steps)")
    group.add_argument("--save-total-limit", type=int, default=2, help="keep at most this many checkpoints")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    group.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        help="resume from a checkpoint folder, or (bare `--resume`) from the latest checkpoint in --output-dir",
    )
    group.add_argument("--num-threads", type=int, help="torch CPU threads (default: torch's choice)")


def training_arguments(args: argparse.Namespace, **overrides):
    """`TrainingArguments` from the shared options."""
    from transformers import TrainingArguments

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    eval_steps = args.eval_steps or max(1, args.max_steps // 4)
    kwargs = {
        "output_dir": args.output_dir,
        "max_steps": args.max_steps,
        "per_device_train_batch_size": args.batch_size,
        "per_device_eval_batch_size": args.batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "warmup_steps": args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20),
        "lr_scheduler_type": "cosine",
        "logging_steps": args.logging_steps,
        "eval_strategy": "steps",
        "eval_steps": eval_steps,
        "save_strategy": "steps",
        "save_steps": args.save_steps or eval_steps,
        "save_total_limit": args.save_total_limit,
        "seed": args.seed,
        "data_seed": args.seed,
        "bf16": args.bf16,
        "report_to": "none",
        "dataloader_num_workers": 0,
        "use_cpu": not torch.cuda.is_available(),
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def resolve_resume(resume: str | None, output_dir: str, marker: str = "trainer_state.json") -> str | None:
    """`--resume` -> a checkpoint folder (or None). `latest` picks the `checkpoint-N` in `output_dir` with the
    largest N that holds `marker` (a complete checkpoint)."""
    if resume is None:
        return None
    if resume == "latest":
        candidates = []
        if os.path.isdir(output_dir):
            for name in os.listdir(output_dir):
                prefix, _, number = name.partition("-")
                if (
                    prefix == "checkpoint"
                    and number.isdigit()
                    and os.path.isfile(os.path.join(output_dir, name, marker))
                ):
                    candidates.append((int(number), os.path.join(output_dir, name)))
        if not candidates:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint-N folder in --output-dir {output_dir!r}; train without --resume "
                "first, or pass the checkpoint folder."
            )
        return max(candidates)[1]
    if not os.path.isfile(os.path.join(resume, marker)):
        raise FileNotFoundError(
            f"--resume {resume!r} is not a checkpoint of this recipe (no {marker}); pass a checkpoint-N folder."
        )
    return resume


def gpt2_config(args: argparse.Namespace, vocab_size: int, tokenizer=None):
    """A DAMCHA (or, with `--model-type gpt2`, plain) GPT-2 config from the size and metric options."""
    from transformers import GPT2Config

    sizes = {
        "vocab_size": vocab_size,
        "n_positions": args.block_size,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "resid_pdrop": args.dropout,
        "embd_pdrop": args.dropout,
        "attn_pdrop": args.dropout,
    }
    if tokenizer is not None:
        sizes.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    if getattr(args, "model_type", "damcha") == "gpt2":
        config = GPT2Config(**sizes)
    else:
        config = damcha_hf.DamchaGPT2Config(**sizes, **metric_options(args))
    config._attn_implementation = args.attn
    return config


def add_gpt2_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model size (new models)")
    group.add_argument("--model-type", choices=("damcha", "gpt2"), default="damcha",
                       help="damcha (default) or gpt2 (plain multi-head attention, the baseline)")  # fmt: skip
    group.add_argument("--n-layer", type=int, default=4)
    group.add_argument("--n-embd", type=int, default=128)
    group.add_argument("--n-head", type=int, default=8)
    group.add_argument("--block-size", type=int, default=128, help="context length in tokens (default: 128)")
    group.add_argument("--dropout", type=float, default=0.0)


def add_text_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default="stdlib",
        help="a text file, folder of .txt files, glob, 'stdlib' (Python's standard library sources; default) or "
        "'gcide' (the GCIDE dictionary)",
    )
    group.add_argument("--file-pattern", default="**/*.txt", help="files to read in a --data folder")
    group.add_argument("--max-data-bytes", type=int, help="read only about this many bytes of text")
    group.add_argument("--validation-fraction", type=float, default=0.05)
    group.add_argument("--tokenizer", default="byte",
                       help="'byte' (default; bits per byte = bits per token), 'bpe' (trained here), "
                       "or a saved tokenizer folder")  # fmt: skip
    group.add_argument("--bpe-vocab-size", type=int, default=4096)


def build_tokenizer(args: argparse.Namespace, corpus):
    from transformers import AutoTokenizer

    from damcha_hf.data import byte_level_tokenizer, train_bpe_tokenizer

    if args.tokenizer == "byte":
        return byte_level_tokenizer()
    if args.tokenizer == "bpe":
        return train_bpe_tokenizer(corpus["train"]["text"], args.bpe_vocab_size)
    if os.path.isdir(args.tokenizer):
        return AutoTokenizer.from_pretrained(args.tokenizer)
    raise ValueError(f"--tokenizer {args.tokenizer!r}: use 'byte', 'bpe' or an existing tokenizer folder.")


def language_model_data(args: argparse.Namespace, tokenizer, corpus=None):
    """(train blocks, validation blocks) from the data options."""
    from damcha_hf.data import group_into_blocks, load_text_corpus

    if corpus is None:
        corpus = load_text_corpus(
            args.data, validation_fraction=args.validation_fraction, seed=args.seed, max_bytes=args.max_data_bytes,
            pattern=args.file_pattern,
        )  # fmt: skip
    # One document per row for folders and 'stdlib'; lines of one text otherwise.
    separate_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    blocks = group_into_blocks(corpus, tokenizer, args.block_size, separate_documents=separate_documents)
    train, validation = blocks["train"], blocks["validation"]
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if args.max_eval_samples is not None:
        validation = validation.select(range(min(args.max_eval_samples, len(validation))))
    return train, validation


def save_final_model(model, folder: str, *, tokenizer_or_processor=None, log_history=None, **card_fields) -> str:
    """Save a Hub-ready checkpoint to `folder` (via `damcha_hf.hub.save_hub_checkpoint` when the package has it:
    weights, config, code, tokenizer or processor, model card, loss curve, metric heatmap). Written to a temporary
    folder first and renamed into place, so an interrupted save never leaves a half-written checkpoint."""
    try:
        from damcha_hf.hub import save_hub_checkpoint
    except ImportError:
        save_hub_checkpoint = None
    if save_hub_checkpoint is not None:
        save_hub_checkpoint(
            model,
            folder,
            tokenizer_or_processor=tokenizer_or_processor,
            log_history=log_history,
            overwrite=True,
            **card_fields,
        )
        return folder
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".saving-", dir=parent)
    model.save_pretrained(staging)
    if tokenizer_or_processor is not None:
        tokenizer_or_processor.save_pretrained(staging)
    if log_history is not None:
        with open(os.path.join(staging, "log_history.json"), "w") as handle:
            json.dump(log_history, handle, indent=1)
    replaced = None
    if os.path.exists(folder):
        replaced = tempfile.mkdtemp(prefix=".replaced-", dir=parent)
        os.replace(folder, os.path.join(replaced, "old"))
    os.replace(staging, folder)
    if replaced is not None:
        shutil.rmtree(replaced)
    return folder


def write_json(path: str, payload: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    staging = f"{path}.tmp"
    with open(staging, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(staging, path)


# ------------------------------------------------------------------------------------------------- image recipes


def add_image_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data", default="fashion-mnist",
                       help="an image folder (<folder>/<label>/<images>) or 'fashion-mnist' (the idx files in "
                       "--fashion-mnist-dir; default)")  # fmt: skip
    group.add_argument("--fashion-mnist-dir", default="/usr/share/datasets/fashion-mnist")
    group.add_argument("--image-size", type=int, default=None, help="resize to this (default: 28 for Fashion-MNIST, "
                       "else 64)")  # fmt: skip
    group.add_argument("--no-augment", action="store_true", help="no random crop / flip of training images")


def image_datasets(args: argparse.Namespace):
    """(DatasetDict with train/validation of `image` + `label`, label names, channels) from the data options."""
    from damcha_hf.data import load_fashion_mnist, load_image_folder

    if args.data == "fashion-mnist":
        train = load_fashion_mnist(args.fashion_mnist_dir, "train", max_samples=args.max_train_samples)
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
    from transformers import ViTImageProcessor

    return ViTImageProcessor(
        size={"height": image_size, "width": image_size},
        image_mean=[0.5] * channels,
        image_std=[0.5] * channels,
        do_convert_rgb=channels == 3,
    )


def random_crop_and_flip(pixel_values: torch.Tensor, padding: int, generator: torch.Generator | None = None):
    """Light augmentation with torch ops only (no torchvision): reflect-pad by `padding`, crop back to the original
    size at a random offset, and flip left-right with probability 1/2. `pixel_values`: (channels, height, width)."""
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

    def transform(batch, train: bool):
        pixel_values = processor(batch["image"], return_tensors="pt")["pixel_values"]
        if train and augment:
            pixel_values = torch.stack([random_crop_and_flip(p, padding) for p in pixel_values])
        return {"pixel_values": pixel_values, "labels": batch["label"]}

    splits["train"].set_transform(lambda batch: transform(batch, True))
    splits["validation"].set_transform(lambda batch: transform(batch, False))


def image_collate(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }
