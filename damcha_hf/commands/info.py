"""`damcha-hf info`: the DAMCHA settings and the generator's share of parameters for a config or checkpoint."""

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="print a model's DAMCHA settings and metric-generator parameter share")
    parser.add_argument(
        "model",
        nargs="?",
        default="gpt2-small",
        help="a checkpoint folder, or a preset: gpt2-small (default), vit-small (ViT-S/16, 224px, 1000 classes)",
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

    import damcha_hf
    from damcha_hf.hub import generator_share

    preset_options = {"cross_head_variant": args.cross_head_variant} if args.cross_head_variant else {}
    if args.model == "gpt2-small":
        config = damcha_hf.DamchaGPT2Config(**preset_options)
        with torch.device("meta"):
            model = damcha_hf.DamchaGPT2Model(config)
    elif args.model == "vit-small":
        # The paper's ImageNet-1K shape, with its 1000-class head, so the share is of the model it trains.
        config = damcha_hf.DamchaViTConfig.vit_small_patch16_224(num_labels=1000, **preset_options)
        with torch.device("meta"):
            model = damcha_hf.DamchaViTForImageClassification(config)
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
