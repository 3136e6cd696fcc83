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
    parser.set_defaults(func=run)


def generator_share(model) -> tuple[int, int]:
    """(metric-generator parameters, all parameters) of a DAMCHA model."""
    total = sum(p.numel() for p in model.parameters())
    generator = sum(p.numel() for name, p in model.named_parameters() if "cross_head_metric" in name)
    return generator, total


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModel

    import damcha_hf

    if args.model == "gpt2-small":
        config = damcha_hf.DamchaGPT2Config()
        with torch.device("meta"):
            model = damcha_hf.DamchaGPT2Model(config)
    elif args.model == "vit-small":
        # The paper's ImageNet-1K shape, with its 1000-class head, so the share is of the model it trains.
        config = damcha_hf.DamchaViTConfig.vit_small_patch16_224(num_labels=1000)
        with torch.device("meta"):
            model = damcha_hf.DamchaViTForImageClassification(config)
    else:
        model = AutoModel.from_pretrained(args.model)
        config = model.config
    generator, total = generator_share(model)
    rows = [("model", f"{type(model).__name__} ({args.model})")]
    rows += [(field, getattr(config, field)) for field in ("metric_context", "metric_mask", "metric_sharing", "metric_hidden_size")]
    rows += [("parameters", f"{total:,}"), ("metric generator", f"{generator:,} ({100 * generator / total:.3f}% of the model)")]
    for label, value in rows:
        print(f"{label + ':':<20}{value}")
    return 0
