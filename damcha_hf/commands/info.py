"""`damcha-hf info`: the DAMCHA settings and the generator's share of parameters for a config or checkpoint."""

import argparse
import ast
import importlib.util
import os
import pkgutil

from damcha_hf.argument_checks import HelpFormatter
from damcha_hf.modeling.variants import CROSS_HEAD_VARIANTS, DEFAULT_VARIANT, VARIANTS

DEFAULT_PRESET = "gpt2-small"


def declared_presets() -> dict[str, str]:
    """Every family's presets, name -> what it is, the default first: the `INFO_PRESETS` literal of each
    `configuration_damcha_*` module (`DamchaFamily.presets` builds them), read from the source so that `--help` imports
    neither torch nor transformers."""
    from damcha_hf import modeling
    from damcha_hf.registration import CONFIG_MODULE_PREFIX

    declared = {}
    for module_info in sorted(pkgutil.iter_modules(modeling.__path__), key=lambda info: info.name):
        if not module_info.name.startswith(CONFIG_MODULE_PREFIX):
            continue
        origin = importlib.util.find_spec(f"{modeling.__name__}.{module_info.name}").origin
        with open(origin, encoding="utf-8") as source:
            tree = ast.parse(source.read(), filename=origin)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "INFO_PRESETS" for target in node.targets
            ):
                declared.update({name: preset["about"] for name, preset in ast.literal_eval(node.value).items()})
    return {DEFAULT_PRESET: declared.pop(DEFAULT_PRESET), **declared}


PRESET_DESCRIPTIONS = declared_presets()
PRESETS = tuple(PRESET_DESCRIPTIONS)
LABEL_WIDTH = 20  # the narrowest label column
PRESET_HELP = ", ".join(f"{name} ({description})" for name, description in PRESET_DESCRIPTIONS.items())


def model_argument(text: str) -> str:
    """A preset name or a checkpoint folder (one with a config.json), checked while parsing."""
    if text in PRESETS or os.path.isfile(os.path.join(text, "config.json")):
        return text
    if not os.path.exists(text):
        # Never a Hub download: `info` answers at once, offline included, from a preset or a local folder.
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint folder; `info` works "
            "offline and does not download Hub ids: save the model to a folder first (e.g. "
            "`AutoConfig.from_pretrained(...).save_pretrained('folder')`) and pass the folder"
        )
    raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder (no config.json)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info",
        help="print a model's DAMCHA settings and metric-generator parameter share",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_PRESET,
        type=model_argument,
        help=f"a checkpoint folder, or a preset: {PRESET_HELP}",
    )
    parser.add_argument(
        "--cross-head-variant",
        default=None,
        choices=CROSS_HEAD_VARIANTS,
        help=f"for a preset: {', '.join(CROSS_HEAD_VARIANTS)} (default {DEFAULT_VARIANT}), to compare the added "
        "parameters",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cross_head_variant and args.model not in PRESETS:  # a checkpoint's variant is the one it was saved with
        raise ValueError(
            f"--cross-head-variant applies to a preset; {args.model} is a checkpoint folder, whose own variant info "
            "prints: leave --cross-head-variant out, or give a preset"
        )
    import torch
    from transformers import AutoConfig, AutoModel

    import damcha_hf
    from damcha_hf.families import presets
    from damcha_hf.hub import generator_share

    preset_options = {"cross_head_variant": args.cross_head_variant} if args.cross_head_variant else {}
    preset = presets().get(args.model)
    if preset is not None:
        model_class, make_config = preset
        config = make_config(**preset_options)
        with torch.device("meta"):
            model = model_class(config)
    else:
        from damcha_hf.safe_files.checkpoint_checks import check_checkpoint_files

        check_checkpoint_files(args.model)  # a damaged checkpoint is named now, not when someone loads it
        config = AutoConfig.from_pretrained(args.model)
        if not config.model_type.startswith("damcha_"):
            raise ValueError(
                f"{args.model} is a {config.model_type!r} checkpoint, not a DAMCHA one; convert it first with "
                "`damcha_hf.convert_to_damcha(model)` and save that, or pass a DAMCHA checkpoint folder."
            )
        # The saved class (e.g. DamchaGPT2LMHeadModel), not AutoModel's base model: its name and parameter count
        # are the checkpoint's.
        saved_class = getattr(damcha_hf, (config.architectures or [""])[0], None)
        with torch.device("meta"):  # the settings and parameter counts need no weights
            model = saved_class(config) if saved_class is not None else AutoModel.from_config(config)
    generator, total = generator_share(model)
    rows = [("model", f"{type(model).__name__} ({args.model})")]
    # The variant and its own fields (DAMCHA's metric_*, a baseline's); an encoder-decoder's DAMCHA settings too: the
    # encoder's context and the cross-attention's generator.
    variant = VARIANTS[config.cross_head_variant]
    rows += [(field, getattr(config, field)) for field in ("cross_head_variant", *variant.fields)]
    encoder_decoder = (("encoder_context", "encoder_context"), ("cross_attention", "cross_attention_metric"))
    if variant.name == "damcha":
        rows += [(label, getattr(config, field)) for label, field in encoder_decoder if hasattr(config, field)]
    rows += [
        ("parameters", f"{total:,}"),
        # What the stock transformers model of this shape has: the published count of the checkpoint it converts from.
        ("stock parameters", f"{total - generator:,}"),
        ("cross-head params", f"{generator:,} ({100 * generator / total:.3f}% of the model)"),
    ]
    # One column of values, past the longest label (a variant's field names are longer than the rest).
    width = max(LABEL_WIDTH, *(len(label) + 2 for label, _ in rows))
    for label, value in rows:
        print(f"{label + ':':<{width}}{value}")
    return 0
