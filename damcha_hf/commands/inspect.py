"""`damcha-hf inspect`: a heatmap of a checkpoint's learned cross-head matrix C, one panel per layer."""

import argparse
import os
import sys
from pathlib import Path

from damcha_hf.argument_checks import HelpFormatter

TEXT_CHUNK_CHARS = 512
MAX_TEXT_CHUNKS = 8


def png_path(text: str) -> str:
    """`--output`: a file path (not a folder) that can be created, checked while parsing."""
    from damcha_hf.safe_files import check_writable_location

    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text} is a folder; give the path of the PNG to write, e.g. {os.path.join(text, 'metric_heatmap.png')}"
        )
    try:
        check_writable_location(Path(text).absolute())
    except OSError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def checkpoint_folder(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint folder (no config.json)")
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        formatter_class=HelpFormatter,
        help="draw the learned cross-head matrix C of a checkpoint (mean over tokens, one panel per layer)",
        description="Run a few inputs through a DAMCHA checkpoint, draw each layer's mean cross-head matrix C as a "
        "heatmap and print each layer's off-diagonal mass sum_{i!=j}|C_ij| / sum|C_ij|.",
    )
    parser.add_argument(
        "checkpoint", type=checkpoint_folder, help="a DAMCHA checkpoint folder (save_pretrained / save_hub_checkpoint)"
    )
    parser.add_argument(
        "--data",
        help="a text file (GPT-2) or a folder of images (ViT); default: a few lines of Python standard-library "
        "source (text) or random images of the configured size (ViT)",
    )
    parser.add_argument(
        "--output",
        type=png_path,
        help="the PNG to write (default: CHECKPOINTNAME_metric_heatmap.png in the current folder; the checkpoint's own "
        "metric_heatmap.png, which its model card shows, is left alone unless you name it here with --overwrite)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.set_defaults(func=run)


def text_chunks(path: Path) -> list[str]:
    """Up to MAX_TEXT_CHUNKS pieces of about TEXT_CHUNK_CHARS characters, split at line ends."""
    chunks, current = [], ""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        current += line
        if len(current) >= TEXT_CHUNK_CHARS:
            chunks.append(current)
            current = ""
        if len(chunks) == MAX_TEXT_CHUNKS:
            break
    if current.strip() and len(chunks) < MAX_TEXT_CHUNKS:
        chunks.append(current)
    return [chunk for chunk in chunks if chunk.strip()]


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoModel

    import damcha_hf  # registers the DAMCHA classes; the saved class is looked up on it
    from damcha_hf.hub import METRIC_HEATMAP_FILE
    from damcha_hf.metric_map import image_folder_inputs, is_vision_model, text_inputs, write_metric_map
    from damcha_hf.safe_files import loading_checkpoint

    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        print(f"damcha-hf inspect: {checkpoint} is not a checkpoint folder (no config.json).", file=sys.stderr)
        return 2
    # The saved class itself (not AutoModel, which would add e.g. an untrained ViT pooler): any DAMCHA class has C.
    with loading_checkpoint(checkpoint, "a DAMCHA checkpoint"):
        architectures = AutoConfig.from_pretrained(checkpoint).architectures or []
        model_class = getattr(damcha_hf, architectures[0], AutoModel) if architectures else AutoModel
        model = model_class.from_pretrained(checkpoint)
    vision = is_vision_model(model)
    tokenizer = image_processor = None
    if vision and (checkpoint / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(checkpoint)
    elif not vision and (checkpoint / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    inputs = None
    if args.data:
        data = Path(args.data)
        if vision and not data.is_dir():
            print(f"damcha-hf inspect: --data {data} must be a folder of images for a vision model.", file=sys.stderr)
            return 2
        if not vision and not data.is_file():
            print(f"damcha-hf inspect: --data {data} must be a text file for a text model.", file=sys.stderr)
            return 2
        try:
            inputs = (
                image_folder_inputs(model, data, image_processor)
                if vision
                else text_inputs(model, text_chunks(data), tokenizer)
            )
        except ValueError as error:
            print(f"damcha-hf inspect: {error}", file=sys.stderr)
            return 2
    output = Path(args.output) if args.output else Path(f"{checkpoint.resolve().name}_{METRIC_HEATMAP_FILE}")
    if output.exists() and not args.overwrite:
        raise FileExistsError(
            f"{output} exists; pass --overwrite to replace it, or --output to write elsewhere"
            + (
                " (it is the checkpoint's own heatmap, shown by its model card)"
                if output.resolve().parent == checkpoint.resolve()
                else ""
            )
        )
    result = write_metric_map(
        model, output, inputs, tokenizer=tokenizer, title=f"{checkpoint.name}: cross-head matrix C"
    )
    print(result.summary())
    print(f"wrote {output} ({result.panels} panels)")
    return 0
