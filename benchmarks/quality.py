"""Quality of DAMCHA against vanilla multi-head attention on small real tasks, with the paper's metric-mask ablation.

Two tasks, every row trained with the same budget, the same seeds and (per seed) the same starting weights: each
DAMCHA model is built from the MHA model of its seed plus a metric generator that starts at zero, so at step 0 all
rows compute the same function and the comparison between rows is paired.

  (a) byte-level language modelling on GCIDE (`/usr/share/dictd/gcide.dict.dz`): the first 10 MB train, the next
      1 MB validation, the next 1 MB test; a small GPT-2; validation and test bits per byte.
      Rows: MHA (vanilla `GPT2LMHeadModel`), DAMCHA "token", DAMCHA "query".
  (b) Fashion-MNIST (`/usr/share/datasets/fashion-mnist/`): a small ViT (patch 4), test top-1.
      Rows: MHA (vanilla `ViTForImageClassification`), DAMCHA "sequence", DAMCHA "token" (once damcha_hf has ViT).
  (c) ablation: every trained DAMCHA model evaluated again with `config.metric_mask = "diagonal"` and
      `"offdiagonal"` (no retraining).

Writes `<out-dir>/<prefix>.json` (every number, per seed), `<prefix>_loss_curves.png` and
`<prefix>_metric_heatmap.png` (the mean cross-head matrix `C` per layer, from the model's `cross_head_metric` on a
validation batch). `--synthetic` swaps the real data for generated data of the same form (for tests).

Examples:
    python benchmarks/quality.py --quick                      # ~5 minutes on 2 cores
    python benchmarks/quality.py                              # the full run (see docs/results.md)
    python benchmarks/quality.py --lm-steps 600 --vit-steps 600 --seeds 0 1 --prefix quality_medium
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (
    count_parameters,
    format_table,
    gpt2_config_kwargs,
    gpt2_rows,
    has_vit,
    save_figure_atomic,
    set_up_device,
    vit_config_kwargs,
    vit_rows,
    write_json_atomic,
)

GCIDE_PATH = "/usr/share/dictd/gcide.dict.dz"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
MB = 1_000_000
ABLATION_MASKS = ("diagonal", "offdiagonal")

PRESETS = {
    # The full run, sized for about an hour on 2 CPU cores shared with other jobs (measured: ~0.3 s per LM step and
    # ~0.5 s per ViT step with one torch thread under that load). Evaluation uses the first `lm_eval_bytes` of the
    # 1 MB validation and test splits, and the first `vit_test_images` of the 10,000 test images.
    "full": {
        "lm_layers": 3, "lm_width": 128, "lm_heads": 8, "lm_context": 64, "lm_batch": 16, "lm_steps": 500, "lm_lr": 2e-3,
        "lm_eval_bytes": 131072, "vit_layers": 4, "vit_width": 64, "vit_heads": 4, "vit_batch": 64, "vit_steps": 500, "vit_lr": 2e-3,
        "vit_test_images": 5000, "metric_hidden_size": 64, "seeds": [0, 1], "log_every": 25,
    },
    "quick": {
        "lm_layers": 2, "lm_width": 64, "lm_heads": 4, "lm_context": 64, "lm_batch": 16, "lm_steps": 60, "lm_lr": 3e-3,
        "lm_eval_bytes": 16384, "vit_layers": 2, "vit_width": 64, "vit_heads": 4, "vit_batch": 32, "vit_steps": 60, "vit_lr": 2e-3,
        "vit_test_images": 1000, "metric_hidden_size": 32, "seeds": [0, 1], "log_every": 10,
    },
    "tiny": {
        "lm_layers": 1, "lm_width": 32, "lm_heads": 4, "lm_context": 16, "lm_batch": 4, "lm_steps": 4, "lm_lr": 3e-3,
        "lm_eval_bytes": 512, "vit_layers": 1, "vit_width": 32, "vit_heads": 4, "vit_batch": 8, "vit_steps": 4, "vit_lr": 2e-3,
        "vit_test_images": 64, "metric_hidden_size": 8, "seeds": [0, 1], "log_every": 2,
    },
}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small preset: about 5 minutes on 2 cores")
    parser.add_argument("--tiny", action="store_true", help="smallest preset, for the tests (seconds)")
    parser.add_argument("--synthetic", action="store_true", help="generated data instead of GCIDE / Fashion-MNIST")
    parser.add_argument("--tasks", nargs="+", default=["lm", "vit"], choices=["lm", "vit"])
    parser.add_argument("--seeds", type=int, nargs="+")
    for name in PRESETS["full"]:
        if name != "seeds":
            kind = float if name.endswith("_lr") else int
            parser.add_argument(f"--{name.replace('_', '-')}", type=kind)
    parser.add_argument(
        "--threads", type=int, default=2,
        help="torch CPU threads (default 2; on a machine shared with other jobs, 1 was about 3x faster here)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    parser.add_argument("--prefix", help="output file prefix (default: quality, quality_quick or quality_tiny)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--parameter-matched-mha", action="store_true",
        help='add the LM row "MHA +params": GPT-2 with MLPs widened to DAMCHA\'s parameter count (control)',
    )  # fmt: skip
    parser.add_argument("--rows", nargs="+", help='run only these rows (e.g. "MHA +params"); default: all')
    parser.add_argument("--replot", metavar="JSON", help="only redraw the tables and figures of an earlier run's JSON")
    parser.add_argument(
        "--merge", metavar="JSON", nargs="+",
        help="combine earlier runs of the same settings but different seeds into <out-dir>/<prefix>.json (and figures)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    preset_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    for key, value in PRESETS[preset_name].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = preset_name
    if args.prefix is None:
        args.prefix = {"full": "quality", "quick": "quality_quick", "tiny": "quality_tiny"}[preset_name]
    if len(args.seeds) < 1:
        parser.error("--seeds needs at least one seed (two or more for a spread)")
    for name in PRESETS["full"]:
        value = getattr(args, name)
        if name != "seeds" and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.lm_width % args.lm_heads or args.vit_width % args.vit_heads:
        parser.error("--lm-heads must divide --lm-width and --vit-heads must divide --vit-width")
    return args


# ----------------------------------------------------------------------------------------------------------- data


def load_gcide(eval_bytes: int, synthetic: bool, seed: int = 0):
    """(train, validation, test) byte tensors: GCIDE's first 10 MB, next 1 MB, next 1 MB (`eval_bytes` of each used)."""
    if synthetic:
        # Words drawn from a small random vocabulary, separated by spaces: learnable, like text, and generated here.
        generator = torch.Generator().manual_seed(seed)
        words = [bytes(torch.randint(97, 123, (int(n),), generator=generator).tolist())
                 for n in torch.randint(2, 8, (50,), generator=generator)]  # fmt: skip
        picks = torch.randint(0, len(words), (40000,), generator=generator).tolist()
        raw = b" ".join(words[i] for i in picks)
        train_end = len(raw) * 8 // 10
        split = (raw[:train_end], raw[train_end : train_end + len(raw) // 10], raw[train_end + len(raw) // 10 :])
    else:
        if not os.path.exists(GCIDE_PATH):
            raise FileNotFoundError(f"GCIDE not found at {GCIDE_PATH}; install dict-gcide or pass --synthetic.")
        with gzip.open(GCIDE_PATH, "rb") as file:
            raw = file.read(12 * MB)
        if len(raw) < 12 * MB:
            raise ValueError(
                f"{GCIDE_PATH} holds {len(raw)} bytes; the benchmark needs 12 MB (10 train, 1 val, 1 test)."
            )
        split = (raw[: 10 * MB], raw[10 * MB : 11 * MB], raw[11 * MB : 12 * MB])
    train, validation, test = (torch.frombuffer(bytearray(part), dtype=torch.uint8).long() for part in split)
    return train, validation[:eval_bytes], test[:eval_bytes]


def _read_idx(path: str) -> torch.Tensor:
    with gzip.open(path, "rb") as file:
        data = file.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an idx file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).view(*shape)


def load_fashion_mnist(synthetic: bool, seed: int = 0):
    """((train images, labels), (test images, labels)); images float (N, 1, 28, 28), normalised."""
    if synthetic:
        generator = torch.Generator().manual_seed(seed)
        prototypes = torch.rand(10, 28, 28, generator=generator) * 255

        def make(count):
            labels = torch.randint(0, 10, (count,), generator=generator)
            noise = torch.randn(count, 28, 28, generator=generator) * 60
            return (prototypes[labels] + noise).clamp(0, 255).to(torch.uint8), labels

        (train_x, train_y), (test_x, test_y) = make(2000), make(500)
    else:
        names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"]  # fmt: skip
        paths = [os.path.join(FASHION_MNIST_DIR, name) for name in names]
        for path in paths:
            if not os.path.exists(path):
                raise FileNotFoundError(f"Fashion-MNIST file {path} not found; pass --synthetic to run without it.")
        train_x, train_y, test_x, test_y = (_read_idx(path) for path in paths)

    def normalise(images):
        return ((images.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)

    return (normalise(train_x), train_y.long()), (normalise(test_x), test_y.long())


# ------------------------------------------------------------------------------------------------------- training


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, next_batch, steps: int, peak_lr: float, log_every: int, label: str):
    """Plain AdamW loop; returns the loss curve [(step, mean loss over the last `log_every` steps)]."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n and "wpe" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wte" not in n and "wpe" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr,
        betas=(0.9, 0.98),
    )  # fmt: skip
    model.train()
    curve, window, started = [], [], time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr)
        loss = model(**next_batch(step)).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{label}: loss became {loss.item()} at step {step}; lower the learning rate.")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        window.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append((step + 1, sum(window) / len(window)))
            window = []
    print(f"  {label}: {steps} steps in {time.time() - started:.0f}s, final train loss {curve[-1][1]:.4f}", flush=True)
    return curve


@torch.no_grad()
def bits_per_byte(model, data: torch.Tensor, context: int, batch: int, device) -> float:
    """Non-overlapping windows: every byte after the first is predicted exactly once, from up to `context` bytes."""
    model.eval()
    windows = (len(data) - 1) // context
    inputs = data[: windows * context].view(windows, context)
    targets = data[1 : windows * context + 1].view(windows, context)
    total_nats, count = 0.0, 0
    for start in range(0, windows, batch):
        x, y = inputs[start : start + batch].to(device), targets[start : start + batch].to(device)
        logits = model(input_ids=x).logits.float()
        total_nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total_nats / count / math.log(2)


@torch.no_grad()
def top1(model, images: torch.Tensor, labels: torch.Tensor, batch: int, device) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(images), batch):
        logits = model(pixel_values=images[start : start + batch].to(device)).logits
        correct += (logits.argmax(-1).cpu() == labels[start : start + batch]).sum().item()
    return correct / len(images)


def cross_head_metric_module(model):
    for name, module in model.named_modules():
        if name.endswith("cross_head_metric"):
            return module
    return None


@torch.no_grad()
def mean_metric_per_layer(model, inputs: dict) -> list[list[list[float]]] | None:
    """The mean cross-head matrix `C` (H x H) of every layer on one batch, as the model's `cross_head_metric` makes it."""
    metric = cross_head_metric_module(model)
    if metric is None:
        return None
    per_layer: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs, output):
        layer = args[1] if len(args) > 1 else kwargs.get("layer_idx", 0)
        per_layer[int(layer)] = output.flatten(0, -3).float().mean(0).cpu()

    handle = metric.register_forward_hook(hook, with_kwargs=True)
    try:
        model.eval()
        model(**inputs)
    finally:
        handle.remove()
    return [per_layer[layer].tolist() for layer in sorted(per_layer)]


def offdiagonal_share(matrix: list[list[float]]) -> float:
    """Frobenius norm of the off-diagonal part of C over that of the whole of C."""
    c = torch.tensor(matrix)
    off = c - torch.diag(torch.diagonal(c))
    return (off.norm() / c.norm()).item()


def with_metric_mask(model, mask: str):
    """Context manager: evaluate a trained DAMCHA model with another `metric_mask` (the paper's ablation)."""

    class _Mask:
        def __enter__(self):
            self.previous = model.config.metric_mask
            model.config.metric_mask = mask

        def __exit__(self, *exc):
            model.config.metric_mask = self.previous

    return _Mask()


# ---------------------------------------------------------------------------------------------------------- tasks


def run_lm(args, device) -> dict:
    train_data, validation, test = load_gcide(args.lm_eval_bytes, args.synthetic)
    print(f"\n== byte-level LM on {'synthetic bytes' if args.synthetic else 'GCIDE'}: train {len(train_data)} bytes, "
          f"validation {len(validation)}, test {len(test)} ==", flush=True)  # fmt: skip
    kwargs = gpt2_config_kwargs(args.lm_layers, args.lm_width, args.lm_heads, args.lm_context, vocab=256)
    context, eval_batch = args.lm_context, 64
    results = {}
    for seed in args.seeds:
        rows = gpt2_rows(
            kwargs,
            contexts=("token", "query"),
            metric_hidden_size=args.metric_hidden_size,
            seed=seed,
            variants=False,
            parameter_matched_mha=args.parameter_matched_mha,
        )
        rows = [row for row in rows if args.rows is None or row.name in args.rows]
        for row in rows:
            generator = torch.Generator().manual_seed(1000 + seed)  # same batches for every row of a seed
            starts = torch.randint(
                0, len(train_data) - context - 1, (args.lm_steps, args.lm_batch), generator=generator
            )

            def next_batch(step, starts=starts):
                window = torch.stack([train_data[s : s + context] for s in starts[step].tolist()]).to(device)
                return {"input_ids": window, "labels": window}

            model = row.build().to(device)
            curve = train(model, next_batch, args.lm_steps, args.lm_lr, args.log_every, f"LM {row.name} seed {seed}")
            record = {
                "seed": seed,
                "parameters": count_parameters(model),
                "curve": curve,
                "validation_bpb": bits_per_byte(model, validation, context, eval_batch, device),
                "test_bpb": bits_per_byte(model, test, context, eval_batch, device),
            }
            if row.kind == "damcha":
                for mask in ABLATION_MASKS:
                    with with_metric_mask(model, mask):  # test split only: evaluation is the costly part on CPU
                        record[f"{mask}_test_bpb"] = bits_per_byte(model, test, context, eval_batch, device)
                sample = validation[: 8 * context].view(8, context).to(device)
                record["mean_metric"] = mean_metric_per_layer(model, {"input_ids": sample})
            results.setdefault(row.name, []).append(record)
            del model
    return results


def run_vit(args, device) -> dict:
    (train_x, train_y), (test_x, test_y) = load_fashion_mnist(args.synthetic)
    test_x, test_y = test_x[: args.vit_test_images], test_y[: args.vit_test_images]
    print(f"\n== Fashion-MNIST{' (synthetic)' if args.synthetic else ''}: train {len(train_x)} images, "
          f"test {len(test_x)} ==", flush=True)  # fmt: skip
    kwargs = vit_config_kwargs(28, 4, 1, args.vit_layers, args.vit_width, args.vit_heads, labels=10)
    if not has_vit():
        print("  (DAMCHA ViT rows skipped: damcha_hf has no DamchaViTConfig yet; only MHA runs)", flush=True)
    results = {}
    for seed in args.seeds:
        rows = vit_rows(kwargs, contexts=("sequence", "token"), metric_hidden_size=args.metric_hidden_size, seed=seed,
                        variants=False)  # fmt: skip
        rows = [row for row in rows if args.rows is None or row.name in args.rows]
        for row in rows:
            generator = torch.Generator().manual_seed(2000 + seed)
            picks = torch.randint(0, len(train_x), (args.vit_steps, args.vit_batch), generator=generator)

            def next_batch(step, picks=picks):
                index = picks[step]
                return {"pixel_values": train_x[index].to(device), "labels": train_y[index].to(device)}

            model = row.build().to(device)
            curve = train(model, next_batch, args.vit_steps, args.vit_lr, args.log_every, f"ViT {row.name} seed {seed}")
            record = {
                "seed": seed,
                "parameters": count_parameters(model),
                "curve": curve,
                "test_top1": top1(model, test_x, test_y, 500, device),
            }
            if row.kind == "damcha":
                for mask in ABLATION_MASKS:
                    with with_metric_mask(model, mask):
                        record[f"{mask}_test_top1"] = top1(model, test_x, test_y, 500, device)
                record["mean_metric"] = mean_metric_per_layer(model, {"pixel_values": test_x[:64].to(device)})
            results.setdefault(row.name, []).append(record)
            del model
    return results


# -------------------------------------------------------------------------------------------------------- reports


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def summarise(task_results: dict, metrics: list[str]) -> dict:
    """Per row and metric: mean, sample std, per-seed values, and the paired difference to MHA (same seed)."""
    reference = {r["seed"]: r for r in task_results.get("MHA", [])}
    summary = {}
    for row, records in task_results.items():
        entry = {"parameters": records[0]["parameters"]}
        for metric in metrics:
            values = [r[metric] for r in records if metric in r]
            if not values:
                continue
            mean, std = mean_std(values)
            entry[metric] = {"mean": mean, "std": std, "per_seed": values}
            paired = [r[metric] - reference[r["seed"]][_base_metric(metric)] for r in records
                      if metric in r and r["seed"] in reference]  # fmt: skip
            if paired and row != "MHA":
                entry[metric]["paired_diff_vs_mha"] = dict(zip(("mean", "std"), mean_std(paired)), per_seed=paired)
        if any("mean_metric" in r and r["mean_metric"] for r in records):
            shares = [[offdiagonal_share(layer) for layer in r["mean_metric"]] for r in records if r.get("mean_metric")]
            entry["offdiagonal_share_per_layer"] = [sum(col) / len(col) for col in zip(*shares)]
        summary[row] = entry
    return summary


def _base_metric(metric: str) -> str:
    for mask in ABLATION_MASKS:
        if metric.startswith(mask + "_"):
            return metric[len(mask) + 1 :]
    return metric


def fmt(entry: dict, metric: str, scale: float = 1.0, digits: int = 3) -> str:
    if metric not in entry:
        return "-"
    value = entry[metric]
    return f"{scale * value['mean']:.{digits}f} ± {scale * value['std']:.{digits}f}"


def fmt_diff(entry: dict, metric: str, scale: float = 1.0, digits: int = 3) -> str:
    if metric not in entry or "paired_diff_vs_mha" not in entry[metric]:
        return "-"
    value = entry[metric]["paired_diff_vs_mha"]
    return f"{scale * value['mean']:+.{digits}f} ± {scale * value['std']:.{digits}f}"


def tables(report: dict) -> str:
    out = []
    seeds = report["args"]["seeds"]
    if "lm" in report["summary"]:
        summary = report["summary"]["lm"]
        headers = ["row", "params", "val bpb", "test bpb", "test Δ vs MHA (paired)", "diagonal-only test bpb",
                   "off-diagonal-only test bpb"]  # fmt: skip
        rows = [[name, f"{e['parameters'] / 1e6:.3f}M", fmt(e, "validation_bpb"), fmt(e, "test_bpb"),
                 fmt_diff(e, "test_bpb"), fmt(e, "diagonal_test_bpb"), fmt(e, "offdiagonal_test_bpb")]
                for name, e in summary.items()]  # fmt: skip
        out.append(
            f"### Byte-level LM (bits per byte, mean ± std over seeds {seeds})\n\n" + format_table(headers, rows)
        )
    if "vit" in report["summary"]:
        summary = report["summary"]["vit"]
        headers = ["row", "params", "test top-1 %", "Δ vs MHA (paired, points)", "diagonal-only top-1 %",
                   "off-diagonal-only top-1 %"]  # fmt: skip
        rows = [[name, f"{e['parameters'] / 1e6:.3f}M", fmt(e, "test_top1", 100, 2), fmt_diff(e, "test_top1", 100, 2),
                 fmt(e, "diagonal_test_top1", 100, 2), fmt(e, "offdiagonal_test_top1", 100, 2)]
                for name, e in summary.items()]  # fmt: skip
        out.append(
            f"### Fashion-MNIST ViT (test top-1, mean ± std over seeds {seeds})\n\n" + format_table(headers, rows)
        )
    shares = []
    for task, summary in report["summary"].items():
        for name, entry in summary.items():
            if "offdiagonal_share_per_layer" in entry:
                per_layer = ", ".join(f"{v:.3f}" for v in entry["offdiagonal_share_per_layer"])
                shares.append([f"{task} {name}", per_layer])
    if shares:
        out.append("### Off-diagonal share of the mean C (||offdiag|| / ||C||, per layer, mean over seeds)\n\n"
                   + format_table(["model", "per layer"], shares))  # fmt: skip
    return "\n\n".join(out)


def plot(report: dict, results: dict, out_dir: str, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    tasks = [t for t in ("lm", "vit") if t in results]
    figure, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7.5), squeeze=False)
    for column, task in enumerate(tasks):
        unit = math.log(2) if task == "lm" else 1.0  # bits per byte for the LM, nats for the classifier
        name = "Byte-level LM (GCIDE)" if task == "lm" else "ViT on Fashion-MNIST"
        reference = {r["seed"]: r["curve"] for r in results[task].get("MHA", [])}
        axis, difference_axis = axes[0][column], axes[1][column]
        for row, records in results[task].items():
            steps = [s for s, _ in records[0]["curve"]]
            losses = [sum(r["curve"][i][1] for r in records) / len(records) / unit for i in range(len(steps))]
            axis.plot(steps, losses, label=row)
            paired = [r for r in records if r["seed"] in reference]
            if paired:
                # (row - MHA of the same seed): the paired view, which the seed-to-seed spread does not blur
                deltas = [sum(r["curve"][i][1] - reference[r["seed"]][i][1] for r in paired) / len(paired) / unit
                          for i in range(len(steps))]  # fmt: skip
                difference_axis.plot(steps, deltas, label=row)
        axis.set_ylabel("train bits per byte" if task == "lm" else "train cross-entropy")
        axis.set_title(f"{name}, mean over seeds")
        axis.set_yscale("log")
        difference_axis.axhline(0.0, color="black", linewidth=0.8)
        difference_axis.set_ylabel("row - MHA, same seed" + (" (bits per byte)" if task == "lm" else ""))
        difference_axis.set_title("paired difference to MHA (negative = better), mean over seeds", fontsize=9)
        for ax in (axis, difference_axis):
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    path = os.path.join(out_dir, f"{prefix}_loss_curves.png")
    save_figure_atomic(figure, path)
    plt.close(figure)
    paths.append(path)

    panels = [(f"{task} {row}", records[0]["mean_metric"]) for task in tasks for row, records in results[task].items()
              if records[0].get("mean_metric")]  # fmt: skip
    if panels:
        layers = max(len(m) for _, m in panels)
        figure, axes = plt.subplots(len(panels), layers, figsize=(2.2 * layers + 1, 2.2 * len(panels)), squeeze=False)
        for row_axes, (title, matrices) in zip(axes, panels):
            limit = max(abs(v) for m in matrices for line in m for v in line)
            for layer, axis in enumerate(row_axes):
                axis.set_xticks([])
                axis.set_yticks([])
                if layer >= len(matrices):
                    axis.axis("off")
                    continue
                image = axis.imshow(matrices[layer], cmap="RdBu_r", vmin=-limit, vmax=limit)
                axis.set_title(f"layer {layer}", fontsize=8)
                if layer == 0:
                    axis.set_ylabel(title, fontsize=8)
            figure.colorbar(image, ax=list(row_axes), shrink=0.8)
        figure.suptitle(f"mean cross-head matrix C (seed {report['args']['seeds'][0]}, one validation batch)")
        path = os.path.join(out_dir, f"{prefix}_metric_heatmap.png")
        save_figure_atomic(figure, path)
        plt.close(figure)
        paths.append(path)
    return paths


def replot(path: str, out_dir: str) -> dict:
    with open(path) as file:
        report = json.load(file)
    print(tables(report))
    prefix = os.path.splitext(os.path.basename(path))[0]
    print("wrote " + ", ".join(plot(report, report["results"], out_dir, prefix)))
    return report


TASK_METRICS = {
    "lm": ["validation_bpb", "test_bpb"] + [f"{m}_test_bpb" for m in ABLATION_MASKS],
    "vit": ["test_top1"] + [f"{m}_test_top1" for m in ABLATION_MASKS],
}
RUN_SETTINGS_IGNORED = {
    "seeds", "tasks", "prefix", "out_dir", "threads", "merge", "replot", "no_plots", "device", "rows",
    "parameter_matched_mha",
}  # fmt: skip


def merge(paths: list[str], out_dir: str, prefix: str) -> dict:
    """One report from several runs that differ only in their seeds (and tasks): the seeds' records are pooled."""
    reports = []
    for path in paths:
        with open(path) as file:
            reports.append(json.load(file))
    settings = [{k: v for k, v in r["args"].items() if k not in RUN_SETTINGS_IGNORED} for r in reports]
    for path, setting in zip(paths[1:], settings[1:]):
        differing = sorted(k for k in setting if setting[k] != settings[0].get(k))
        if differing:
            raise ValueError(f"--merge: {path} was run with other settings than {paths[0]}: {', '.join(differing)}")
    results: dict = {}
    for report in reports:
        for task, rows in report["results"].items():
            for row, records in rows.items():
                pooled = results.setdefault(task, {}).setdefault(row, [])
                seeds = {r["seed"] for r in pooled}
                duplicate = seeds & {r["seed"] for r in records}
                if duplicate:
                    raise ValueError(f"--merge: seed(s) {sorted(duplicate)} of {task} {row} appear in two runs")
                pooled.extend(records)
    all_seeds = sorted({r["seed"] for rows in results.values() for records in rows.values() for r in records})
    report = {
        "machine": reports[0]["machine"],
        "torch": reports[0]["torch"],
        "args": {**reports[0]["args"], "seeds": all_seeds, "prefix": prefix, "merged_from": paths},
        "data": reports[0]["data"],
        "wall_seconds": sum(r["wall_seconds"] for r in reports),
        "summary": {task: summarise(rows, TASK_METRICS[task]) for task, rows in results.items()},
        "results": results,
    }
    report["tables"] = tables(report)
    print(report["tables"])
    json_path = os.path.join(out_dir, f"{prefix}.json")
    write_json_atomic(json_path, report)
    print("wrote " + ", ".join([json_path] + plot(report, results, out_dir, prefix)))
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out_dir)
    if args.merge:
        return merge(args.merge, args.out_dir, args.prefix)
    device, machine = set_up_device(args.device, args.threads)
    print(f"quality.py ({args.preset} preset) on {machine}; args: {vars(args)}", flush=True)
    started = time.time()
    results, summary = {}, {}
    if "lm" in args.tasks:
        results["lm"] = run_lm(args, device)
        summary["lm"] = summarise(results["lm"], TASK_METRICS["lm"])
    if "vit" in args.tasks:
        results["vit"] = run_vit(args, device)
        summary["vit"] = summarise(results["vit"], TASK_METRICS["vit"])
    report = {
        "machine": machine,
        "torch": torch.__version__,
        "args": vars(args),
        "data": "synthetic" if args.synthetic else {"lm": GCIDE_PATH, "vit": FASHION_MNIST_DIR},
        "wall_seconds": time.time() - started,
        "summary": summary,
        "results": results,
    }
    report["tables"] = tables(report)
    print("\n" + report["tables"], flush=True)
    json_path = os.path.join(args.out_dir, f"{args.prefix}.json")
    write_json_atomic(json_path, report)
    written = [json_path] + ([] if args.no_plots else plot(report, results, args.out_dir, args.prefix))
    print(f"\nwrote {', '.join(written)} in {report['wall_seconds']:.0f}s total", flush=True)
    return report


if __name__ == "__main__":
    main()
