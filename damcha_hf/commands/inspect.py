"""`damcha-hf inspect`: a heatmap of a checkpoint's learned cross-head matrix C, one panel per layer."""

import argparse
import os
from pathlib import Path

from damcha_hf.argument_checks import HelpFormatter, non_negative_int, text_file_or_folder

TEXT_CHUNK_CHARS = 512
MAX_TEXT_CHUNKS = 8
# diffusers' file name for a noise schedule, which train_diffusion.py saves beside the denoiser.
SCHEDULER_CONFIG = "scheduler_config.json"
# The schedule a denoiser checkpoint without its own is taken to have: DDPM's (as `damcha_hf.diffusion`'s default).
DEFAULT_TRAIN_TIMESTEPS = 1000
NOISE_SEED = 0


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
        description="Run a few inputs through a DAMCHA checkpoint (GPT-2, Llama, ViT, BART or the ViT denoiser), draw "
        "each layer's mean cross-head matrix C as a heatmap and print each layer's off-diagonal mass "
        "sum_{i!=j}|C_ij| / sum|C_ij|.",
    )
    parser.add_argument(
        "checkpoint", type=checkpoint_folder, help="a DAMCHA checkpoint folder (save_pretrained / save_hub_checkpoint)"
    )
    parser.add_argument(
        "--data",
        type=text_file_or_folder,
        help="a text file (text models) or a folder of images (vision models); default: a few lines of Python "
        "standard-library source (text) or random images of the configured size (vision)",
    )
    parser.add_argument(
        "--timestep",
        type=non_negative_int,
        help="for a diffusion denoiser: the noise level its inputs are at (default: the middle of its training "
        f"schedule, from the checkpoint's {SCHEDULER_CONFIG}, else of DDPM's {DEFAULT_TRAIN_TIMESTEPS} steps)",
    )
    parser.add_argument(
        "--output",
        type=png_path,
        help="the PNG to write (default: CHECKPOINTNAME_metric_heatmap.png beside the checkpoint folder; the "
        "checkpoint's own metric_heatmap.png, which its model card shows, is left alone unless you name it here with "
        "--overwrite)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output if it exists and is a picture damcha-hf drew"
    )
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


def default_output(checkpoint: Path) -> Path:
    """CHECKPOINTNAME_metric_heatmap.png beside the checkpoint folder, never inside it (its card shows its own)."""
    from damcha_hf.safe_files import METRIC_HEATMAP_FILE

    folder = checkpoint.resolve()
    return folder.parent / f"{folder.name}_{METRIC_HEATMAP_FILE}"


def check_output(output: Path, checkpoint: Path, *, overwrite: bool) -> None:
    """Refuse, before the model loads, an output that cannot be written, one that exists (without `--overwrite`), and
    one that is not a picture damcha-hf drew (a PNG with its `Software` mark), which is never replaced."""
    from damcha_hf.safe_files import METRIC_HEATMAP_FILE, PNG_SOFTWARE, check_writable_location, png_text
    from damcha_hf.safe_files.atomic_files import UnsafeOutputError

    check_writable_location(output.absolute(), argument="--output")
    if not output.exists() and not output.is_symlink():
        return
    own = output.resolve() == (checkpoint / METRIC_HEATMAP_FILE).resolve()
    whose = " (the checkpoint's own heatmap, shown by its model card)" if own else ""
    if output.is_symlink() or not output.is_file():
        raise UnsafeOutputError(f"--output {output} exists and is not a regular file; choose another --output path.")
    if not overwrite:
        raise UnsafeOutputError(
            f"{output} exists{whose}; pass --overwrite to replace it, or --output to write elsewhere"
        )
    if not (png_text(output, "Software") or "").startswith(PNG_SOFTWARE):
        raise UnsafeOutputError(
            f"--output {output}{whose} is not a picture damcha-hf drew (its PNG has no damcha-hf mark), so it is not "
            "replaced, --overwrite or not; choose another --output path, or move the file away yourself"
        )


def checkpoint_family(checkpoint: Path):
    """The DAMCHA family a checkpoint's config.json names, read before the model loads; a checkpoint with no
    cross-head matrix C to draw is refused in one line."""
    from damcha_hf.families import family_for_model_type
    from damcha_hf.safe_files import MODEL_TYPE_PREFIX
    from damcha_hf.safe_files.checkpoint_checks import read_json_file

    config = read_json_file(checkpoint / "config.json", "a config")
    if not isinstance(config, dict):
        raise ValueError(f"{checkpoint / 'config.json'}: not a config (a JSON object)")
    model_type = config.get("model_type")
    family = family_for_model_type(model_type)
    if family is None or not str(model_type).startswith(MODEL_TYPE_PREFIX):
        convertible = "; convert it with `damcha_hf.convert_to_damcha` and fine-tune it first" if family else ""
        raise ValueError(
            f"{checkpoint} holds a {model_type!r} model, not a DAMCHA checkpoint: it has no cross-head matrix C to "
            f"draw{convertible}"
        )
    variant = config.get("cross_head_variant", "damcha")
    if variant != "damcha":
        raise ValueError(
            f"{checkpoint} runs `cross_head_variant={variant!r}`, which has no cross-head matrix C to draw; inspect "
            "draws DAMCHA (`cross_head_variant='damcha'`) checkpoints"
        )
    return family


def check_data(data: Path, *, vision: bool) -> None:
    """`--data` fits the model: a text file for a text model, a folder holding images for a vision model."""
    from damcha_hf.metric_map import IMAGE_SUFFIXES

    if vision and not data.is_dir():
        raise ValueError(
            f"--data {data} is a file; a vision model reads a folder of images ({', '.join(IMAGE_SUFFIXES)})"
        )
    if not vision and data.is_dir():
        raise ValueError(f"--data {data} is a folder; a text model reads a text file")
    if vision and not any(path.suffix.lower() in IMAGE_SUFFIXES for path in data.iterdir()):
        raise ValueError(f"--data {data}: no images ({', '.join(IMAGE_SUFFIXES)}) in this folder")


def noise_schedule(checkpoint: Path) -> dict:
    """The denoiser's training schedule (diffusers' scheduler config), or DDPM's default when it has none saved."""
    from damcha_hf.safe_files.checkpoint_checks import read_json_file

    path = checkpoint / SCHEDULER_CONFIG
    schedule = read_json_file(path, "a noise schedule") if path.is_file() else {}
    steps = schedule.get("num_train_timesteps", DEFAULT_TRAIN_TIMESTEPS) if isinstance(schedule, dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{path}: not a noise schedule (no positive `num_train_timesteps`); the file is damaged")
    return {**schedule, "num_train_timesteps": steps}


def noised(pixel_values, schedule: dict, timestep: int):
    """Images noised to `timestep` of the schedule, `sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise` (fixed noise)."""
    import torch

    from damcha_hf import diffusion

    scheduler = diffusion.require_diffusers().DDPMScheduler.from_config(schedule)
    noise = torch.randn(pixel_values.shape, generator=torch.Generator().manual_seed(NOISE_SEED))
    return scheduler.add_noise(pixel_values, noise, torch.full((len(pixel_values),), timestep))


def run(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    # Everything the arguments can get wrong is refused before the model loads.
    family = checkpoint_family(checkpoint)
    data = Path(args.data) if args.data else None
    texts = None
    if data is not None:
        check_data(data, vision=family.vision)
        if not family.vision:
            texts = text_chunks(data)
            if not texts:
                raise ValueError(f"--data {data} holds only blank lines; give a text file with some text")

    from damcha_hf.metric_map import needs_timestep

    denoiser = needs_timestep(family.heads[0].model_class)
    timestep = schedule = None
    if denoiser:
        schedule = noise_schedule(checkpoint)
        steps = schedule["num_train_timesteps"]
        timestep = steps // 2 if args.timestep is None else args.timestep
        if timestep >= steps:
            raise ValueError(f"--timestep {timestep}: the denoiser's schedule has timesteps 0 to {steps - 1}")
        if data is not None:
            from damcha_hf.diffusion import require_diffusers

            require_diffusers()  # noises the images of --data with the checkpoint's schedule
    elif args.timestep is not None:
        raise ValueError(
            f"--timestep applies to a diffusion denoiser; {checkpoint} holds a {family.display_name} model"
        )
    output = Path(args.output) if args.output else default_output(checkpoint)
    check_output(output, checkpoint, overwrite=args.overwrite)

    from transformers import AutoConfig, AutoModel

    import damcha_hf  # registers the DAMCHA classes; the saved class is looked up on it
    from damcha_hf.metric_map import image_folder_inputs, text_inputs, write_metric_map
    from damcha_hf.safe_files.checkpoint_checks import loading_checkpoint

    # The saved class itself (not AutoModel, which would add e.g. an untrained ViT pooler): any DAMCHA class has C.
    with loading_checkpoint(checkpoint, "a DAMCHA checkpoint"):
        architectures = AutoConfig.from_pretrained(checkpoint).architectures or []
        model_class = getattr(damcha_hf, architectures[0], AutoModel) if architectures else AutoModel
        model = model_class.from_pretrained(checkpoint)
    tokenizer = image_processor = None
    if family.vision and (checkpoint / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(checkpoint)
    elif not family.vision and (checkpoint / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    inputs = None
    if data is not None and family.vision:
        inputs = image_folder_inputs(model, data, image_processor)
        if denoiser:
            inputs = [{**batch, "pixel_values": noised(batch["pixel_values"], schedule, timestep)} for batch in inputs]
    elif texts is not None:
        inputs = text_inputs(model, texts, tokenizer)
    if denoiser:
        print(f"noise level: timestep {timestep} of the {schedule['num_train_timesteps']}-step schedule")
    result = write_metric_map(
        model, output, inputs, tokenizer=tokenizer, title=f"{checkpoint.resolve().name}: cross-head matrix C",
        timestep=timestep,
    )  # fmt: skip
    print(result.summary())
    print(f"wrote {output} ({result.panels} panels)")
    return 0
