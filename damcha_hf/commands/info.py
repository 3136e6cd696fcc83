"""`damcha-hf info`: the DAMCHA settings and the generator's share of parameters for a config or checkpoint."""

import argparse

# The presets every family declares (`DamchaFamily.presets`), listed here without importing torch for `--help`.
PRESET_HELP = (
    "gpt2-small (default), tinyllama (TinyLlama-1.1B, GQA 32/4 heads), vit-small (ViT-S/16, 224px, 1000 classes)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="print a model's DAMCHA settings and metric-generator parameter share")
    parser.add_argument(
        "model", nargs="?", default="gpt2-small", help=f"a checkpoint folder, or a preset: {PRESET_HELP}"
    )
    parser.add_argument(
        "--cross-head-variant",
        default=None,
        help="for a preset: damcha (default), talking_heads, dcmha or none, to compare the added parameters",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModel

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
        model = AutoModel.from_pretrained(args.model)
        config = model.config
    generator, total = generator_share(model)
    rows = [("model", f"{type(model).__name__} ({args.model})")]
    fields = ("cross_head_variant", "metric_context", "metric_mask", "metric_sharing", "metric_hidden_size")
    rows += [(field, getattr(config, field)) for field in fields]
    rows += [
        ("parameters", f"{total:,}"),
        ("cross-head params", f"{generator:,} ({100 * generator / total:.3f}% of the model)"),
    ]
    for label, value in rows:
        print(f"{label + ':':<20}{value}")
    return 0
