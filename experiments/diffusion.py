"""Diffusion on Fashion-MNIST: the ViT denoiser with multi-head attention, DAMCHA and DCMHA, paired by seed.

For each seed, one MHA denoiser is built and saved (`<runs-dir>/init-seed<S>`); every method then trains from it with
recipes/train_diffusion.py (`--init-from`: DAMCHA's generator and DCMHA's composition start as the identity, so every
method starts as the same function), on the same batches, noise draws and schedule (the `Trainer` seeds them from
`--seed`). Each run reports the held-out denoising error per timestep range and the Fréchet classifier distance (FCD)
of DDIM samples against held-out images, in the feature space of `--feature-classifier` (a ViT classifier trained by
recipes/train_vit.py). The summary gives, per method, the mean ± standard error over seeds and, per method against
MHA, the mean paired difference with its two-sided 95% Student-t interval.

A run already finished in `<runs-dir>` (its `eval_results.json` present) is read, not repeated, so the script
resumes where it stopped. Writes `<out>` (every number, per seed) after each run, and side-by-side sample grids.

    python recipes/train_vit.py --cross-head-variant none --hidden-size 64 --num-layers 4 --num-heads 4 \\
        --max-steps 800 --output-dir runs/fcd-classifier
    python experiments/diffusion.py --feature-classifier runs/fcd-classifier/final --seeds 0 1 2 --max-steps 500
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root (for `experiments.common`) and the recipes folder (for `train_diffusion`).
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPOSITORY)
sys.path.insert(0, os.path.join(REPOSITORY, "recipes"))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402  (standard library only)
from damcha_hf.optional_packages import check_extras  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import (  # noqa: E402  (torch-free)
    InputFileError,
    format_table,
    paired_statistics,
    read_json_input,
)

RESULTS_FILE = "the eval_results.json recipes/train_diffusion.py writes"

METHODS = {  # name -> the recipe's attention flags
    "MHA": ["--cross-head-variant", "none"],
    "DAMCHA": ["--cross-head-variant", "damcha", "--metric-context", "sequence"],
    "DCMHA": ["--cross-head-variant", "dcmha"],
    # The capacity control: MHA with a wider MLP (--wide-mlp-size), as many parameters as DCMHA within a few hundred.
    "MHA-wide": ["--cross-head-variant", "none"],
}
CONTROLS = {"MHA-wide": "DCMHA"}  # control -> the method it matches in parameters
METRICS = ("fcd", "mse", "mse_t000-249", "mse_t250-499", "mse_t500-749", "mse_t750-999")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feature-classifier", required=True, help="the FCD's ViT classifier checkpoint folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=tuple(METHODS), default=list(METHODS))
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--image-size", type=int, default=28, help="the data's (resized) image size")
    parser.add_argument("--channels", type=int, default=1, help="the data's channels: 1 (grey) or 3 (colour)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--metric-hidden-size", type=int, default=16)
    parser.add_argument("--wide-mlp-size", type=int, default=304,
                        help="MLP width of the MHA-wide control (304: DCMHA's parameter count at the default size)")  # fmt: skip
    parser.add_argument("--sample-steps", type=int, default=20, help="DDIM steps per sample")
    parser.add_argument("--fcd-samples", type=int, default=500, help="generated and held-out images for the FCD")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads of each run")
    parser.add_argument("--runs-dir", default="runs/diffusion-comparison")
    parser.add_argument("--out", default="experiments/diffusion-fashion-mnist/results.json")
    parser.add_argument("--recipe-args", nargs=argparse.REMAINDER, default=[],
                        help="further train_diffusion.py flags for every run (last on the line)")  # fmt: skip
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_extras(parser, "experiments/diffusion.py", "experiments", "diffusion")
    return args


def initial_model(args, seed: int, mlp_size: int | None = None) -> str:
    """The seed's MHA denoiser, saved once: every method of the seed starts from it (the MHA-wide control from one with
    a `mlp_size` MLP, built from the same seed)."""
    mlp_size = mlp_size or 4 * args.hidden_size
    suffix = "" if mlp_size == 4 * args.hidden_size else f"-mlp{mlp_size}"
    folder = os.path.join(args.runs_dir, f"init-seed{seed}{suffix}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoModel  # noqa: F401  (loads the Auto classes before the DAMCHA models)

    import damcha_hf

    torch.manual_seed(seed)
    config = damcha_hf.DamchaViTDenoiserConfig(
        image_size=args.image_size, patch_size=args.patch_size, num_channels=args.channels, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, intermediate_size=mlp_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, cross_head_variant="none",
        metric_hidden_size=args.metric_hidden_size,
    )  # fmt: skip
    damcha_hf.DamchaViTDenoiserModel(config).save_pretrained(folder)
    return folder


def run(args, method: str, seed: int) -> dict:
    output_dir = os.path.join(args.runs_dir, f"{method.lower()}-seed{seed}")
    results_file = os.path.join(output_dir, "eval_results.json")
    if not os.path.isfile(results_file):
        import train_diffusion

        train_diffusion.main([
            "--init-from", initial_model(args, seed, args.wide_mlp_size if method in CONTROLS else None),
            *METHODS[method], "--seed", str(seed), "--image-size",
            str(args.image_size),
            # The generator's width is DAMCHA's setting: another variant's run refuses it.
            *(["--metric-hidden-size", str(args.metric_hidden_size)] if "damcha" in METHODS[method] else []),
            "--max-steps", str(args.max_steps),
            "--batch-size", str(args.batch_size), "--learning-rate", str(args.learning_rate),
            "--sample-steps", str(args.sample_steps), "--feature-classifier", args.feature_classifier,
            "--fcd-samples", str(args.fcd_samples), "--max-eval-samples", str(args.fcd_samples),
            "--num-threads", str(args.threads), "--logging-steps", "50", "--output-dir", output_dir,
            "--overwrite-output-dir", *args.recipe_args,
        ])  # fmt: skip
    try:
        results = read_json_input(results_file, "--runs-dir", holds=RESULTS_FILE)
        config = read_json_input(os.path.join(output_dir, "final", "config.json"), "--runs-dir",
                                 holds="the config.json of the run's final model")  # fmt: skip
    except InputFileError as error:
        raise SystemExit(f"diffusion.py: error: {error}; move the run's folder away to train it again") from None
    from safetensors import safe_open

    with safe_open(os.path.join(output_dir, "final", "model.safetensors"), "pt") as weights:
        parameters = sum(_numel(weights, name) for name in weights.keys())  # noqa: SIM118 (safe_open is not iterable)
    return {"metrics": {key.removeprefix("eval_"): value for key, value in results.items() if key.startswith("eval_")},
            "train_loss": results.get("train_loss"), "global_step": results.get("global_step"),
            "parameters": parameters, "cross_head_variant": config.get("cross_head_variant"),
            "folder": output_dir}  # fmt: skip


def _numel(weights, name: str) -> int:
    count = 1
    for size in weights.get_slice(name).get_shape():
        count *= size
    return count


def paired_against(records: dict, method: str, reference: str) -> dict:
    seeds = sorted(set(records[method]) & set(records[reference]))
    return {
        metric: paired_statistics(
            [records[method][seed]["metrics"][metric] - records[reference][seed]["metrics"][metric] for seed in seeds]
        )
        for metric in METRICS
        if seeds and all(metric in records[reference][seed]["metrics"] for seed in seeds)
    }


def summarize(records: dict) -> dict:
    """Per method: mean ± SE over seeds; per method against MHA (and a method against its capacity control): paired
    differences with t-intervals."""
    summary = {"per_method": {}, "against_mha": {}, "against_control": {}}
    for method, by_seed in records.items():
        summary["per_method"][method] = {
            metric: paired_statistics([run["metrics"][metric] for run in by_seed.values() if metric in run["metrics"]])
            for metric in METRICS
            if sum(metric in run["metrics"] for run in by_seed.values()) >= 1
        }
    for method in records:
        if method != "MHA" and "MHA" in records:
            summary["against_mha"][method] = paired_against(records, method, "MHA")
    for control, method in CONTROLS.items():
        if control in records and method in records:
            summary["against_control"][f"{method} minus {control}"] = paired_against(records, method, control)
    return summary


def number(stats: dict, digits: int = 4) -> str:
    if stats.get("se") is None:
        return f"{stats['mean']:.{digits}f} (n={stats['n']})"
    return f"{stats['mean']:.{digits}f} ± {stats['se']:.{digits}f}"


def interval(stats: dict, digits: int = 4) -> str:
    if stats.get("low") is None:
        return "n/a"
    return f"[{stats['low']:+.{digits}f}, {stats['high']:+.{digits}f}]"


def tables(summary: dict) -> str:
    rows = [[method, *(number(stats[metric]) for metric in ("fcd", "mse"))]
            for method, stats in summary["per_method"].items()]  # fmt: skip
    text = format_table(["method", "FCD (mean ± SE)", "held-out MSE (mean ± SE)"], rows)
    rows = []
    comparisons = {f"{method} minus MHA": stats for method, stats in summary["against_mha"].items()}
    comparisons.update(summary.get("against_control", {}))
    for method, stats in comparisons.items():
        for metric in METRICS:
            if metric in stats:
                s = stats[metric]
                rows.append([method, metric, f"{s['mean']:+.4f}", f"{s['se']:.4f}" if s["se"] is not None else "n/a",
                             interval(s), f"{s['agree_in_sign']}/{s['n']}"])  # fmt: skip
    return text + "\n\n" + format_table(["comparison", "metric", "mean difference", "SE", "95% t-interval", "seeds agreeing"],
                                        rows)  # fmt: skip


def side_by_side(records: dict, seed: int, path: str) -> None:
    """The methods' final sample grids of one seed (the same start noise), left to right, in one PNG."""
    from PIL import Image

    from damcha_hf.safe_files.atomic_files import atomic_path

    grids = [Image.open(os.path.join(by_seed[seed]["folder"], "final", "sample_grid.png")).convert("L")
             for by_seed in records.values() if seed in by_seed]  # fmt: skip
    if not grids:
        return
    gap = 8
    canvas = Image.new("L", (sum(g.width for g in grids) + gap * (len(grids) - 1), max(g.height for g in grids)), 255)
    left = 0
    for grid in grids:
        canvas.paste(grid, (left, 0))
        left += grid.width + gap
    with atomic_path(path) as temporary:
        canvas.save(temporary, format="PNG")


def main(argv=None) -> dict:
    args = parse_args(argv)
    records: dict[str, dict[int, dict]] = {method: {} for method in args.methods}
    payload = {}
    for seed in args.seeds:  # seed by seed, so that a stopped comparison leaves complete pairs
        for method in args.methods:
            records[method][seed] = run(args, method, seed)
            payload = {"command": " ".join(["python", "experiments/diffusion.py", *(argv or sys.argv[1:])]),
                       "settings": {k: v for k, v in vars(args).items() if k != "recipe_args"} | {
                           "recipe_args": args.recipe_args},
                       "runs": {m: {str(s): r for s, r in by_seed.items()} for m, by_seed in records.items()},
                       "summary": summarize(records)}  # fmt: skip
            write_json(args.out, payload)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    for seed in args.seeds:
        side_by_side(records, seed, os.path.join(out_dir, f"samples_seed{seed}.png"))
    print(tables(payload["summary"]))
    return payload


if __name__ == "__main__":
    main()
