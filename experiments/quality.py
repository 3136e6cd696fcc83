"""Quality of DAMCHA against vanilla multi-head attention and the paper's baselines on small real tasks.

Two tasks, every row trained with the same budget, the same seeds and (per seed) the same starting weights: each
DAMCHA or baseline model is the MHA model of its seed converted exactly (`convert_to_damcha`: DAMCHA's metric
generator, talking-heads' and DCMHA's head mixing all start as the identity), so at step 0 all rows compute the same
function, see the same batches, and the comparison between rows is paired.

  (a) byte-level language modelling on GCIDE (`/usr/share/dictd/gcide.dict.dz`): the first 10 MB train, the next
      1 MB validation, the next 1 MB test; a small GPT-2; validation and test bits per byte.
      Rows: MHA (vanilla `GPT2LMHeadModel`), DAMCHA "token", DAMCHA "query", talking_heads, DCMHA.
  (b) Fashion-MNIST (`/usr/share/datasets/fashion-mnist/`): a small ViT (patch 4), test top-1.
      Rows: MHA (vanilla `ViTForImageClassification`), DAMCHA "sequence", DAMCHA "token", talking_heads, DCMHA.
  (c) ablation: every trained DAMCHA model evaluated again with `config.metric_mask = "diagonal"` and
      `"offdiagonal"` (no retraining).
  (d) `--upcycle`: pretrain MHA for `--pretrain-steps`, then continue `--continue-steps` as MHA, as
      `convert_to_damcha(...)` per metric context, and (`--lora`) LoRA on the converted model against LoRA on the MHA
      model (the LoRA recipe's targets and trained modules), all from the same pretrained weights and batches.

Statistics: every difference between two rows is paired by seed; the script prints its mean, its standard error over
seeds, a two-sided 95% Student-t interval (n - 1 degrees of freedom) and how many seeds agree in sign, and states a
claim against the paper's table only where that interval excludes zero ("confirmed" / "contradicted"; otherwise
"not shown").

Writes `<out-dir>/<prefix>.json` (every number, per seed), `<prefix>_loss_curves.png` and
`<prefix>_metric_heatmap.png`. The default `--out-dir` is a new folder `runs/quality/<prefix>-<UTC time>`, so a run
never overwrites committed results; pass `--out-dir docs` (and `--overwrite` to replace a file there) on purpose.
`--synthetic` swaps the real data for generated data of the same form (for tests).

Examples:
    python benchmarks/quality.py --quick                      # 30 steps per row: a smoke test (timing: README)
    python benchmarks/quality.py                              # the full run (see docs/results.md)
    python benchmarks/quality.py --tasks lm --lm-steps 2000 --seeds 0 1 2 --prefix lm_long
    python benchmarks/quality.py --upcycle --lora --tasks lm --pretrain-steps 400 --continue-steps 200
    python benchmarks/quality.py --lengths runs/lm_1000.json runs/lm_5000.json   # the same rows trained longer
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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (
    Row,
    count_parameters,
    format_table,
    gpt2_config_kwargs,
    gpt2_rows,
    save_figure_atomic,
    set_up_device,
    vit_config_kwargs,
    vit_rows,
    write_json_atomic,
)

from damcha_hf import convert_to_damcha
from damcha_hf.families import family_of

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))

GCIDE_PATH = "/usr/share/dictd/gcide.dict.dz"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
MB = 1_000_000
ABLATION_MASKS = ("diagonal", "offdiagonal")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_VARIANTS = {"talking_heads": "talking_heads", "dcmha": "DCMHA"}  # cross_head_variant -> row name

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
        "lm_layers": 2, "lm_width": 64, "lm_heads": 4, "lm_context": 64, "lm_batch": 16, "lm_steps": 30, "lm_lr": 3e-3,
        "lm_eval_bytes": 8192, "vit_layers": 2, "vit_width": 64, "vit_heads": 4, "vit_batch": 32, "vit_steps": 30, "vit_lr": 2e-3,
        "vit_test_images": 500, "metric_hidden_size": 32, "seeds": [0, 1], "log_every": 5,
    },
    "tiny": {
        "lm_layers": 1, "lm_width": 32, "lm_heads": 4, "lm_context": 16, "lm_batch": 4, "lm_steps": 4, "lm_lr": 3e-3,
        "lm_eval_bytes": 512, "vit_layers": 1, "vit_width": 32, "vit_heads": 4, "vit_batch": 8, "vit_steps": 4, "vit_lr": 2e-3,
        "vit_test_images": 64, "metric_hidden_size": 8, "seeds": [0, 1], "log_every": 2,
    },
}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small preset, 30 steps per row: a smoke test (its timing: the README's quick runs)",
    )
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
    parser.add_argument(
        "--out-dir",
        help="where the JSON and figures go (default: a new folder runs/quality/<prefix>-<UTC time> in the repository; "
        "committed results in docs/ are only written when named here)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing <out-dir>/<prefix>.json")
    parser.add_argument("--prefix", help="output file prefix (default: quality, quality_quick or quality_tiny)")
    parser.add_argument(
        "--no-baselines", action="store_true", help="skip the talking_heads and DCMHA rows (MHA and DAMCHA only)"
    )
    upcycle = parser.add_argument_group("upcycling (--upcycle): pretrain MHA, then continue as MHA or converted")
    upcycle.add_argument("--upcycle", action="store_true", help="run the upcycling experiment instead of the rows")
    upcycle.add_argument("--pretrain-steps", type=int, help="MHA pretraining steps (default: half the task's steps)")
    upcycle.add_argument("--continue-steps", type=int, help="continuation steps per arm (default: half the steps)")
    upcycle.add_argument("--lora", action="store_true", help="add LoRA arms: LoRA on MHA vs LoRA on converted DAMCHA")
    upcycle.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--parameter-matched-mha", action="store_true",
        help='add the row "MHA +params": MHA with MLPs widened to DAMCHA\'s parameter count (control; LM and ViT)',
    )  # fmt: skip
    parser.add_argument(
        "--dcmha-matched-mha", action="store_true",
        help='add the row "MHA +DCMHA params": MHA with MLPs widened to DCMHA\'s parameter count (control; LM and ViT)',
    )  # fmt: skip
    parser.add_argument("--rows", nargs="+", help='run only these rows (e.g. "MHA +params"); default: all')
    parser.add_argument("--replot", metavar="JSON", help="only redraw the tables and figures of an earlier run's JSON")
    parser.add_argument(
        "--merge", metavar="JSON", nargs="+",
        help="combine earlier runs of the same settings but different seeds into <out-dir>/<prefix>.json (and figures)",
    )  # fmt: skip
    parser.add_argument(
        "--lengths", metavar="JSON", nargs="+",
        help="compare earlier runs (or merges) of the same settings but different step counts: per training length, "
        "MHA's test metric, its paired change from the previous length and each row's paired difference to MHA; "
        "writes <out-dir>/<prefix>.json",
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
    for name in ("pretrain_steps", "continue_steps", "lora_rank"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if (args.lora or args.pretrain_steps or args.continue_steps) and not args.upcycle:
        parser.error("--lora, --pretrain-steps and --continue-steps belong to --upcycle; add --upcycle")
    if (
        args.upcycle
        and args.prefix == {"full": "quality", "quick": "quality_quick", "tiny": "quality_tiny"}[preset_name]
    ):
        args.prefix += "_upcycle"
    if args.out_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        args.out_dir = os.path.join(REPOSITORY, "runs", "quality", f"{args.prefix}-{stamp}")
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


PROGRESS_SECONDS = 60.0


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
    reported = started  # a progress line at most once a PROGRESS_SECONDS, so long rows show they are alive
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
            now = time.time()
            if now - reported >= PROGRESS_SECONDS and step + 1 < steps:
                reported, per_step = now, (now - started) / (step + 1)
                print(f"  {label}: step {step + 1}/{steps}, train loss {curve[-1][1]:.4f}, {1000 * per_step:.0f} "
                      f"ms/step, about {per_step * (steps - step - 1) / 60:.0f} min left", flush=True)  # fmt: skip
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


@dataclass
class Task:
    """What the generic loops need of a task: its rows, its batches, its evaluation."""

    name: str  # "lm" or "vit"
    title: str
    steps: int
    lr: float
    contexts: tuple[str, ...]  # the DAMCHA rows' metric contexts
    rows: Callable[[int], list[Row]]  # seed -> rows, MHA first
    batches: Callable[[int, int], Callable[[int], dict]]  # (generator seed, steps) -> step -> batch
    evaluate: Callable[[torch.nn.Module], dict]  # metrics of a trained model
    ablate: Callable[[torch.nn.Module], dict]  # metrics under the ablation masks (DAMCHA rows)
    metric_inputs: Callable[[], dict]  # one evaluation batch, for the mean cross-head matrix
    device: torch.device


def baseline_rows(mha: Row, seed: int) -> list[Row]:
    """talking_heads and DCMHA rows: the seed's MHA model converted exactly (their mixing starts as the identity, on
    eager attention, which they need), so they share the MHA row's starting function and batches."""

    def build(variant):
        def make():
            reference = mha.build()
            torch.manual_seed(seed + 1)
            return convert_to_damcha(reference, cross_head_variant=variant).train()

        return make

    return [Row(name, build(variant), "variant") for variant, name in BASELINE_VARIANTS.items()]


def lm_task(args, device) -> Task:
    train_data, validation, test = load_gcide(args.lm_eval_bytes, args.synthetic)
    print(f"\n== byte-level LM on {'synthetic bytes' if args.synthetic else 'GCIDE'}: train {len(train_data)} bytes, "
          f"validation {len(validation)}, test {len(test)} ==", flush=True)  # fmt: skip
    kwargs = gpt2_config_kwargs(args.lm_layers, args.lm_width, args.lm_heads, args.lm_context, vocab=256)
    context, eval_batch = args.lm_context, 64

    def rows(seed):
        built = gpt2_rows(kwargs, contexts=("token", "query"), metric_hidden_size=args.metric_hidden_size, seed=seed,
                          variants=False, parameter_matched_mha=args.parameter_matched_mha,
                          dcmha_matched_mha=args.dcmha_matched_mha)  # fmt: skip
        if not args.no_baselines:
            built += baseline_rows(built[0], seed)
        return built

    def batches(generator_seed, steps):
        generator = torch.Generator().manual_seed(generator_seed)
        starts = torch.randint(0, len(train_data) - context - 1, (steps, args.lm_batch), generator=generator)

        def next_batch(step):
            window = torch.stack([train_data[s : s + context] for s in starts[step].tolist()]).to(device)
            return {"input_ids": window, "labels": window}

        return next_batch

    def evaluate(model):
        return {"validation_bpb": bits_per_byte(model, validation, context, eval_batch, device),
                "test_bpb": bits_per_byte(model, test, context, eval_batch, device)}  # fmt: skip

    def ablate(model):
        record = {}
        for mask in ABLATION_MASKS:
            with with_metric_mask(model, mask):  # test split only: evaluation is the costly part on CPU
                record[f"{mask}_test_bpb"] = bits_per_byte(model, test, context, eval_batch, device)
        return record

    return Task("lm", "LM", args.lm_steps, args.lm_lr, ("token", "query"), rows, batches, evaluate, ablate,
                lambda: {"input_ids": validation[: 8 * context].view(8, context).to(device)}, device)  # fmt: skip


def vit_task(args, device) -> Task:
    (train_x, train_y), (test_x, test_y) = load_fashion_mnist(args.synthetic)
    test_x, test_y = test_x[: args.vit_test_images], test_y[: args.vit_test_images]
    print(f"\n== Fashion-MNIST{' (synthetic)' if args.synthetic else ''}: train {len(train_x)} images, "
          f"test {len(test_x)} ==", flush=True)  # fmt: skip
    kwargs = vit_config_kwargs(28, 4, 1, args.vit_layers, args.vit_width, args.vit_heads, labels=10)

    def rows(seed):
        built = vit_rows(kwargs, contexts=("sequence", "token"), metric_hidden_size=args.metric_hidden_size, seed=seed,
                         variants=False, parameter_matched_mha=args.parameter_matched_mha,
                         dcmha_matched_mha=args.dcmha_matched_mha)  # fmt: skip
        if not args.no_baselines:
            built += baseline_rows(built[0], seed)
        return built

    def batches(generator_seed, steps):
        generator = torch.Generator().manual_seed(generator_seed)
        picks = torch.randint(0, len(train_x), (steps, args.vit_batch), generator=generator)

        def next_batch(step):
            index = picks[step]
            return {"pixel_values": train_x[index].to(device), "labels": train_y[index].to(device)}

        return next_batch

    def evaluate(model):
        return {"test_top1": top1(model, test_x, test_y, 500, device)}

    def ablate(model):
        record = {}
        for mask in ABLATION_MASKS:
            with with_metric_mask(model, mask):
                record[f"{mask}_test_top1"] = top1(model, test_x, test_y, 500, device)
        return record

    return Task("vit", "ViT", args.vit_steps, args.vit_lr, ("sequence", "token"), rows, batches, evaluate, ablate,
                lambda: {"pixel_values": test_x[:64].to(device)}, device)  # fmt: skip


BATCH_SEED_OFFSET = {"lm": 1000, "vit": 2000}  # batches of seed s come from generator seed offset + s
CONTINUE_SEED_OFFSET = 3000  # the continuation batches of --upcycle: new data after the pretraining's


def run_task(task: Task, args, on_record: Callable[[dict], None] = lambda results: None) -> dict:
    results = {}
    for seed in args.seeds:
        rows = [row for row in task.rows(seed) if args.rows is None or row.name in args.rows]
        for row in rows:
            next_batch = task.batches(BATCH_SEED_OFFSET[task.name] + seed, task.steps)  # same batches for every row
            model = row.build().to(task.device)
            started = time.time()
            curve = train(
                model, next_batch, task.steps, task.lr, args.log_every, f"{task.title} {row.name} seed {seed}"
            )
            step_seconds = (time.time() - started) / task.steps
            record = {"seed": seed, "parameters": count_parameters(model), "step_seconds": step_seconds, "curve": curve,
                      **task.evaluate(model)}  # fmt: skip
            if row.kind == "damcha":
                record.update(task.ablate(model))
                record["mean_metric"] = mean_metric_per_layer(model, task.metric_inputs())
            results.setdefault(row.name, []).append(record)
            on_record(results)
            del model
    return results


def lora_wrap(model, rank: int):
    """LoRA as `recipes/finetune_lora.py` sets it up: its family's target modules, the cross-head modules (and a task
    head) trained in full, everything else frozen."""
    from finetune_lora import cross_head_modules  # the recipe's own choice of fully trained modules
    from peft import LoraConfig, get_peft_model

    family = family_of(model)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(family.lora_target_modules),
        modules_to_save=cross_head_modules(model.config) + list(family.task_head_modules),
        fan_in_fan_out=family.lora_fan_in_fan_out, bias="none",
    )  # fmt: skip
    return get_peft_model(model, config)


def upcycle_arms(task: Task, lora_rank: int | None, metric_hidden_size: int) -> list[tuple[str, Callable]]:
    """(name, pretrained MHA -> model to continue) per arm; every arm starts from the pretrained function exactly."""

    def convert(**options):
        return lambda model: convert_to_damcha(model, metric_hidden_size=metric_hidden_size, **options)

    arms = [("MHA", lambda model: model)]
    arms += [(f"DAMCHA {context}", convert(metric_context=context)) for context in task.contexts]
    if lora_rank:
        # "none" is exactly MHA in the DAMCHA classes, whose module names the recipe's LoRA targets use.
        none, damcha = convert(cross_head_variant="none"), convert(metric_context=task.contexts[0])
        arms.append(("LoRA MHA", lambda model: lora_wrap(none(model), lora_rank)))
        arms.append((f"LoRA DAMCHA {task.contexts[0]}", lambda model: lora_wrap(damcha(model), lora_rank)))
    return arms


def run_upcycle(task: Task, args, on_record: Callable[[dict], None] = lambda results: None) -> dict:
    """Pretrain MHA, then continue every arm from the same pretrained weights on the same batches."""
    pretrain_steps = args.pretrain_steps or max(1, task.steps // 2)
    continue_steps = args.continue_steps or max(1, task.steps // 2)
    results = {}
    for seed in args.seeds:
        mha = task.rows(seed)[0]
        pretrained = mha.build()
        next_batch = task.batches(BATCH_SEED_OFFSET[task.name] + seed, pretrain_steps)
        pretrained.to(task.device)
        pretrain_curve = train(pretrained, next_batch, pretrain_steps, task.lr, args.log_every,
                               f"{task.title} pretrain MHA seed {seed}")  # fmt: skip
        pretrained_metrics = task.evaluate(pretrained)
        state = {key: value.clone() for key, value in pretrained.state_dict().items()}
        for name, make in upcycle_arms(task, args.lora_rank if args.lora else None, args.metric_hidden_size):
            start = mha.build()
            start.load_state_dict(state)
            torch.manual_seed(seed + 1)
            model = make(start.to(task.device)).train()
            continue_batch = task.batches(CONTINUE_SEED_OFFSET + BATCH_SEED_OFFSET[task.name] + seed, continue_steps)
            started = time.time()
            curve = train(model, continue_batch, continue_steps, task.lr, args.log_every,
                          f"{task.title} continue {name} seed {seed}")  # fmt: skip
            record = {
                "seed": seed,
                "parameters": count_parameters(model),
                "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "step_seconds": (time.time() - started) / continue_steps,
                "curve": curve,
                "pretrain_curve": pretrain_curve,
                "pretrained": pretrained_metrics,
                **task.evaluate(model),
            }
            results.setdefault(name, []).append(record)
            on_record(results)
            del model
    return results


# -------------------------------------------------------------------------------------------------------- reports


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with a whole number `df` of degrees of freedom: the closed form as a finite series in
    theta = atan(|t| / sqrt(df)) (Abramowitz and Stegun 26.7.3-4), exact and cheap; no SciPy needed."""
    if df < 1 or df != int(df):
        raise ValueError(f"student_t_cdf: df must be a whole number of at least 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    series, term = (0.0, 1.0) if df == 1 else (1.0, 1.0)
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), (df - 1) / 2 terms
        for k in range(1, (int(df) - 1) // 2):
            term *= 2 * k / (2 * k + 1) * cos2
            series += term
        within = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df / 2 terms
        for k in range(1, int(df) // 2):
            term *= (2 * k - 1) / (2 * k) * cos2
            series += term
        within = math.sin(theta) * series
    return 0.5 + within / 2 if t >= 0 else 0.5 - within / 2  # `within` = P(|T| <= |t|)


def student_t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom (bisection on the CDF)."""
    if not 0 < probability < 1:
        raise ValueError(f"student_t_quantile: probability must be in (0, 1), got {probability}")
    if probability < 0.5:
        return -student_t_quantile(1 - probability, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < probability:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2


CONFIDENCE = 0.95


def paired_statistics(differences: list[float], confidence: float = CONFIDENCE) -> dict:
    """Mean of per-seed paired differences, its standard error (sample std / sqrt(n)), the two-sided Student-t
    interval with n - 1 degrees of freedom, and how many seeds share the mean's sign."""
    n = len(differences)
    mean, std = mean_std(differences)
    stats = {"n": n, "mean": mean, "std": std, "per_seed": list(differences),
             "agree_in_sign": sum(1 for d in differences if d * mean > 0)}  # fmt: skip
    if n < 2:
        stats.update(se=None, t_critical=None, low=None, high=None)
        return stats
    se = std / math.sqrt(n)
    t_critical = student_t_quantile(0.5 + confidence / 2, n - 1)
    stats.update(se=se, t_critical=t_critical, low=mean - t_critical * se, high=mean + t_critical * se)
    return stats


def verdict(stats: dict, expected_sign: int) -> str:
    """The verdict on a claim: "confirmed" if the interval lies on the side the paper's table predicts,
    "contradicted" if on the other side, "not shown" if it contains zero (or there are fewer than two seeds)."""
    if stats.get("low") is None:
        return "not shown"
    if stats["low"] > 0 or stats["high"] < 0:
        return "confirmed" if (stats["low"] > 0) == (expected_sign > 0) else "contradicted"
    return "not shown"


def paired_differences(task_results: dict, row: str, reference: str, metric: str) -> list[float]:
    """row - reference of the same seed, for the seeds both have."""
    by_seed = {r["seed"]: r for r in task_results.get(reference, []) if metric in r}
    return [
        r[metric] - by_seed[r["seed"]][metric]
        for r in task_results.get(row, [])
        if metric in r and r["seed"] in by_seed
    ]


def step_time_ratio(task_results: dict, row: str, reference: str) -> float | None:
    """Mean over seeds of row's seconds per training step over the reference's (same seed)."""
    by_seed = {r["seed"]: r for r in task_results.get(reference, []) if r.get("step_seconds")}
    ratios = [r["step_seconds"] / by_seed[r["seed"]]["step_seconds"] for r in task_results.get(row, [])
              if r.get("step_seconds") and r["seed"] in by_seed]  # fmt: skip
    return sum(ratios) / len(ratios) if ratios else None


# Capacity controls: vanilla MHA widened to a method's parameter count, and the rows each one is the control for.
CAPACITY_CONTROLS = {"MHA +params": "DAMCHA ", "MHA +DCMHA params": "DCMHA"}


def comparison_pairs(rows: list[str]) -> list[tuple[str, str]]:
    """Every row against MHA, every baseline against every DAMCHA row (DAMCHA - baseline), and each method against
    the MHA widened to its parameter count, when that control ran."""
    damcha = [r for r in rows if r.startswith("DAMCHA") or r.startswith("LoRA DAMCHA")]
    baselines = [r for r in rows if r in BASELINE_VARIANTS.values()]
    pairs = [(r, "MHA") for r in rows if r != "MHA" and "MHA" in rows and not r.startswith("LoRA")]
    pairs += [(d, b) for d in damcha for b in baselines]
    pairs += [(r, control) for control, prefix in CAPACITY_CONTROLS.items() if control in rows
              for r in rows if r.startswith(prefix)]  # fmt: skip
    if "LoRA MHA" in rows:
        pairs += [(r, "LoRA MHA") for r in rows if r.startswith("LoRA DAMCHA")]
    return pairs


def compare(task_results: dict, metrics: list[str]) -> list[dict]:
    """The paired statistics of every comparison pair, per metric, with the step-time ratio of the pair."""
    comparisons = []
    for row, reference in comparison_pairs(list(task_results)):
        for metric in metrics:
            differences = paired_differences(task_results, row, reference, metric)
            if differences:
                comparisons.append({"row": row, "reference": reference, "metric": metric,
                                    "step_time_ratio": step_time_ratio(task_results, row, reference),
                                    **paired_statistics(differences)})  # fmt: skip
    return comparisons


# The paper's table: (task, metric, row, reference, expected sign of row - reference, the paper's figures).
PAPER_CLAIMS = [
    ("lm", "test_bpb", "DAMCHA", "DCMHA", -1, "GPT-2 cross-entropy: DAMCHA 1.04 vs DCMHA 1.08"),
    ("vit", "test_top1", "DAMCHA", "DCMHA", +1, "ViT-S/16 top-1: DAMCHA 82.10% vs DCMHA 81.70%"),
    ("vit", "test_top1", "DAMCHA", "MHA", +1, "ViT-S/16 top-1: DAMCHA 82.10% vs MHA 79.51%"),
    ("vit", "test_top1", "DCMHA", "MHA", +1, "ViT-S/16 top-1: DCMHA 81.70% vs MHA 79.51%"),
]


def paper_verdicts(comparisons_per_task: dict) -> list[dict]:
    """Each claim of the paper's table, per DAMCHA row that ran, judged on its paired interval."""
    verdicts = []
    for task, metric, row, reference, sign, claim in PAPER_CLAIMS:
        for comparison in comparisons_per_task.get(task, []):
            if comparison["metric"] != metric or comparison["reference"] != reference:
                continue
            name = comparison["row"]
            if name != row and not (row == "DAMCHA" and name.startswith("DAMCHA ")):
                continue
            verdicts.append({"task": task, "claim": claim, "row": name, "reference": reference, "metric": metric,
                             "verdict": verdict(comparison, sign), **{k: comparison[k] for k in
                             ("n", "mean", "se", "low", "high", "agree_in_sign")}})  # fmt: skip
    return verdicts


def summarise(task_results: dict, metrics: list[str]) -> dict:
    """Per row and metric: mean, sample std, per-seed values, the paired difference to MHA (same seed) and the mean
    seconds per training step; under "comparisons", the paired statistics of every comparison pair."""
    reference = {r["seed"]: r for r in task_results.get("MHA", [])}
    summary = {}
    for row, records in task_results.items():
        entry = {"parameters": records[0]["parameters"]}
        steps = [r["step_seconds"] for r in records if r.get("step_seconds")]
        if steps:
            entry["step_seconds"] = sum(steps) / len(steps)
        for metric in metrics:
            values = [r[metric] for r in records if metric in r]
            if not values:
                continue
            mean, std = mean_std(values)
            entry[metric] = {"mean": mean, "std": std, "per_seed": values}
            paired = [r[metric] - reference[r["seed"]][_base_metric(metric)] for r in records
                      if metric in r and r["seed"] in reference]  # fmt: skip
            if paired and row != "MHA":
                entry[metric]["paired_diff_vs_mha"] = paired_statistics(paired)
        if any("mean_metric" in r and r["mean_metric"] for r in records):
            shares = [[offdiagonal_share(layer) for layer in r["mean_metric"]] for r in records if r.get("mean_metric")]
            entry["offdiagonal_share_per_layer"] = [sum(col) / len(col) for col in zip(*shares)]
        summary[row] = entry
    return summary


def gap_over_training(task_results: dict, unit: float, points: int = 4) -> list[dict]:
    """Paired training-loss gap (row - reference, same seed and batches) at `points` evenly spaced logged steps, per
    comparison pair, in `unit`s (ln 2 turns the LM's nats into bits per byte): does a gap open, hold or close?"""
    gaps = []
    for row, reference in comparison_pairs(list(task_results)):
        curves = {r["seed"]: dict(r["curve"]) for r in task_results[reference]}
        records = [r for r in task_results[row] if r["seed"] in curves]
        if not records:
            continue
        logged = [step for step, _ in records[0]["curve"]]
        picks = sorted({logged[max(0, round(len(logged) * (i + 1) / points) - 1)] for i in range(points)})
        for step in picks:
            differences = [(dict(r["curve"])[step] - curves[r["seed"]][step]) / unit for r in records
                           if step in dict(r["curve"]) and step in curves[r["seed"]]]  # fmt: skip
            if differences:
                gaps.append({"row": row, "reference": reference, "step": step, **paired_statistics(differences)})
    return gaps


def analyse(results: dict) -> dict:
    """summary (per task and row), comparisons (per task) and the verdicts on the paper's claims, from the records."""
    summary = {task: summarise(rows, TASK_METRICS[task]) for task, rows in results.items()}
    comparisons = {task: compare(rows, [m for m in TASK_METRICS[task] if not m.startswith(ABLATION_MASKS)])
                   for task, rows in results.items()}  # fmt: skip
    gaps = {task: gap_over_training(rows, math.log(2) if task == "lm" else 1.0) for task, rows in results.items()}
    return {"summary": summary, "comparisons": comparisons, "paper_verdicts": paper_verdicts(comparisons),
            "training_gaps": gaps}  # fmt: skip


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


def fmt_paired(stats: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    """mean ± SE [interval] (k/n same sign), or mean (1 seed)."""
    if not stats:
        return "-"
    if stats.get("se") is None:
        return f"{scale * stats['mean']:+.{digits}f} (1 seed)"
    low, high = sorted((scale * stats["low"], scale * stats["high"]))
    return (f"{scale * stats['mean']:+.{digits}f} ± {abs(scale) * stats['se']:.{digits}f} "
            f"[{low:+.{digits}f}, {high:+.{digits}f}] ({stats['agree_in_sign']}/{stats['n']})")  # fmt: skip


def fmt_diff(entry: dict, metric: str, scale: float = 1.0, digits: int = 3) -> str:
    if metric not in entry or "paired_diff_vs_mha" not in entry[metric]:
        return "-"
    return fmt_paired(entry[metric]["paired_diff_vs_mha"], scale, digits)


def fmt_step(entry: dict) -> str:
    return f"{1000 * entry['step_seconds']:.0f}" if entry.get("step_seconds") else "-"


METRIC_FORMAT = {  # metric -> (label, scale, digits)
    "validation_bpb": ("val bpb", 1.0, 3), "test_bpb": ("test bpb", 1.0, 3), "test_top1": ("test top-1 points", 100.0, 2),
}  # fmt: skip


def tables(report: dict) -> str:
    out = []
    # the seeds that finished (a partial report lists more in its arguments than it has records for)
    seeds = sorted({r["seed"] for rows in report["results"].values() for records in rows.values() for r in records})
    upcycle = report["args"].get("upcycle")
    summaries = report["summary"]
    if "lm" in summaries:
        summary = summaries["lm"]
        headers = ["row", "params", "ms/step", "val bpb", "test bpb", "test Δ vs MHA (paired)", "diagonal-only test bpb",
                   "off-diagonal-only test bpb"]  # fmt: skip
        rows = [[name, f"{e['parameters'] / 1e6:.3f}M", fmt_step(e), fmt(e, "validation_bpb"), fmt(e, "test_bpb"),
                 fmt_diff(e, "test_bpb"), fmt(e, "diagonal_test_bpb"), fmt(e, "offdiagonal_test_bpb")]
                for name, e in summary.items()]  # fmt: skip
        title = "Upcycled byte-level LM (after continuing)" if upcycle else "Byte-level LM"
        out.append(f"### {title} (bits per byte, mean ± std over seeds {seeds})\n\n" + format_table(headers, rows))
    if "vit" in summaries:
        summary = summaries["vit"]
        headers = ["row", "params", "ms/step", "test top-1 %", "Δ vs MHA (paired, points)", "diagonal-only top-1 %",
                   "off-diagonal-only top-1 %"]  # fmt: skip
        rows = [[name, f"{e['parameters'] / 1e6:.3f}M", fmt_step(e), fmt(e, "test_top1", 100, 2),
                 fmt_diff(e, "test_top1", 100, 2), fmt(e, "diagonal_test_top1", 100, 2),
                 fmt(e, "offdiagonal_test_top1", 100, 2)] for name, e in summary.items()]  # fmt: skip
        title = "Upcycled Fashion-MNIST ViT (after continuing)" if upcycle else "Fashion-MNIST ViT"
        out.append(f"### {title} (test top-1, mean ± std over seeds {seeds})\n\n" + format_table(headers, rows))
    comparisons = [[task, f"{c['row']} − {c['reference']}", METRIC_FORMAT[c["metric"]][0],
                    fmt_paired(c, *METRIC_FORMAT[c["metric"]][1:]),
                    "-" if c["step_time_ratio"] is None else f"{c['step_time_ratio']:.2f}x"]
                   for task, items in report.get("comparisons", {}).items() for c in items]  # fmt: skip
    if comparisons:
        out.append(
            f"### Paired differences (mean ± standard error over seeds [two-sided {100 * CONFIDENCE:.0f}% Student-t "
            "interval, n-1 df] (seeds agreeing in sign / seeds); step time: row's seconds per step over the "
            "reference's, same seed)\n\n"
            + format_table(["task", "difference", "metric", "paired difference", "step time"], comparisons)
        )
    gaps = {}
    for task, items in report.get("training_gaps", {}).items():
        for gap in items:
            gaps.setdefault((task, gap["row"], gap["reference"]), []).append(gap)
    if gaps:
        steps = sorted({g["step"] for items in gaps.values() for g in items})
        out.append(
            "### Paired training-loss gap over training (row − reference, same batches; LM in bits per byte, ViT in "
            "nats; mean ± SE [95% t] (agree/n) over the logging window ending at each step)\n\n"
            + format_table(
                ["task", "difference"] + [f"step {s}" for s in steps],
                [
                    [task, f"{row} − {reference}"]
                    + [next((fmt_paired(g) for g in items if g["step"] == s), "-") for s in steps]
                    for (task, row, reference), items in gaps.items()
                ],
            )  # fmt: skip
        )
    verdicts = [[v["claim"], f"{v['row']} − {v['reference']}",
                 fmt_paired(v, *METRIC_FORMAT[v["metric"]][1:]), v["verdict"]]
                for v in report.get("paper_verdicts", [])]  # fmt: skip
    if verdicts and not upcycle:
        out.append("### Against the paper's table (a claim only where the interval excludes zero)\n\n"
                   + format_table(["paper", "here", "paired difference [95% t interval] (agree/n)", "verdict"],
                                  verdicts))  # fmt: skip
    shares = []
    for task, summary in summaries.items():
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
    figure, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7.5), squeeze=False, layout="constrained")
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
    report.update(analyse(report["results"]))  # recomputed, so older reports get the current statistics
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
    "parameter_matched_mha", "dcmha_matched_mha", "overwrite", "no_baselines",
}  # fmt: skip


def merge(paths: list[str], out_dir: str, prefix: str, overwrite: bool = False, plots: bool = True) -> dict:
    """One report from several runs that differ only in their seeds (and tasks): the seeds' records are pooled.
    Its figures are drawn unless `plots` is false (`--no-plots`)."""
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
        **analyse(results),
        "results": results,
    }
    report["tables"] = tables(report)
    print(report["tables"])
    json_path = os.path.join(out_dir, f"{prefix}.json")
    refuse_to_overwrite(json_path, overwrite)
    write_json_atomic(json_path, report)
    print("wrote " + ", ".join([json_path] + (plot(report, results, out_dir, prefix) if plots else [])))
    return report


# The test metric of each task, by which training lengths are compared.
LENGTH_METRIC = {"lm": "test_bpb", "vit": "test_top1"}


def training_lengths(paths: list[str], out_dir: str, prefix: str, overwrite: bool = False) -> dict:
    """Where the plateau is, and what training longer does to each gap: runs of the same settings but the task's step
    count (each possibly a `--merge` of several seeds), compared on the seeds every run has.

    A seed's runs share their starting weights and the order of their batches (a longer run sees the shorter run's
    batches first), so MHA's change from one length to the next is paired by seed, as is every row's difference to
    MHA at each length.
    """
    reports = []
    for path in paths:
        with open(path) as file:
            reports.append(json.load(file))
    ignored = RUN_SETTINGS_IGNORED | {"lm_steps", "vit_steps", "log_every", "merged_from", "finished"}
    comparison = {}
    for task, metric in LENGTH_METRIC.items():
        if not all(task in r["results"] for r in reports):
            continue
        # The settings of this task and the shared ones; the other task's (`vit_*` for "lm") do not bear on it.
        other_tasks = tuple(f"{other}_" for other in LENGTH_METRIC if other != task)
        settings = [{k: v for k, v in r["args"].items() if k not in ignored and not k.startswith(other_tasks)}
                    for r in reports]  # fmt: skip
        for path, setting in zip(paths[1:], settings[1:]):
            differing = sorted(k for k in set(setting) | set(settings[0]) if setting.get(k) != settings[0].get(k))
            if differing:
                raise ValueError(
                    f"--lengths: {path} differs from {paths[0]} in more than its steps: {', '.join(differing)}"
                )
        ordered = sorted(reports, key=lambda r: r["args"][f"{task}_steps"])
        steps = [r["args"][f"{task}_steps"] for r in ordered]
        if len(set(steps)) != len(steps):
            raise ValueError(f"--lengths: two runs train {task} for the same number of steps ({steps})")
        rows = [row for row in ordered[0]["results"][task] if all(row in r["results"][task] for r in ordered)]
        if "MHA" not in rows:
            raise ValueError(f"--lengths: every run needs an MHA row for {task}")
        seeds = sorted(set.intersection(*({rec["seed"] for row in rows for rec in r["results"][task][row]}
                                          for r in ordered)))  # fmt: skip
        by_length = []
        previous = None
        for report, length in zip(ordered, steps):
            values = {row: {rec["seed"]: rec[metric] for rec in report["results"][task][row] if rec["seed"] in seeds}
                      for row in rows}  # fmt: skip
            mha = values["MHA"]
            entry = {"steps": length, "seeds": seeds, "mha": dict(zip(("mean", "std"), mean_std(list(mha.values()))))}
            if previous is not None:
                previous_length, previous_mha = previous
                entry["mha_change"] = paired_statistics([mha[s] - previous_mha[s] for s in seeds])
                entry["mha_change_per_doubling"] = entry["mha_change"]["mean"] / math.log2(length / previous_length)
            entry["vs_mha"] = {row: paired_statistics([values[row][s] - mha[s] for s in seeds if s in values[row]])
                               for row in rows if row != "MHA"}  # fmt: skip
            by_length.append(entry)
            previous = (length, mha)
        comparison[task] = {"metric": metric, "rows": rows, "by_length": by_length}
    if not comparison:
        raise ValueError("--lengths: the runs share no task")
    report = {"args": {"lengths": paths, "prefix": prefix}, "lengths": comparison,
              "tables": length_tables(comparison)}  # fmt: skip
    print(report["tables"])
    json_path = os.path.join(out_dir, f"{prefix}.json")
    refuse_to_overwrite(json_path, overwrite)
    write_json_atomic(json_path, report)
    print(f"wrote {json_path}")
    return report


def length_tables(comparison: dict) -> str:
    out = []
    for task, entry in comparison.items():
        metric = entry["metric"]
        label, scale, digits = METRIC_FORMAT[metric]
        others = [row for row in entry["rows"] if row != "MHA"]
        headers = ["steps", f"MHA {label}", "MHA change from the previous length (paired)", "per doubling of steps"]
        headers += [f"{row} − MHA" for row in others]
        rows = []
        for length in entry["by_length"]:
            mha = length["mha"]
            rows.append([str(length["steps"]), f"{scale * mha['mean']:.{digits}f} ± {scale * mha['std']:.{digits}f}",
                         fmt_paired(length.get("mha_change"), scale, digits),
                         f"{scale * length['mha_change_per_doubling']:+.{digits}f}" if "mha_change" in length else "-"]
                        + [fmt_paired(length["vs_mha"][row], scale, digits) for row in others])  # fmt: skip
        seeds = entry["by_length"][0]["seeds"]
        out.append(f"### {task}: {label} by training length (paired over seeds {seeds}: mean ± SE [95% t] "
                   f"(agree/n))\n\n" + format_table(headers, rows))  # fmt: skip
    return "\n\n".join(out)


def refuse_to_overwrite(json_path: str, overwrite: bool) -> None:
    if os.path.exists(json_path) and not overwrite:
        raise SystemExit(
            f"quality.py: {json_path} exists; pass --overwrite to replace it, or another --out-dir / --prefix."
        )


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out_dir)
    if args.merge:
        return merge(args.merge, args.out_dir, args.prefix, args.overwrite, plots=not args.no_plots)
    if args.lengths:
        return training_lengths(args.lengths, args.out_dir, args.prefix, args.overwrite)
    json_path = os.path.join(args.out_dir, f"{args.prefix}.json")
    refuse_to_overwrite(json_path, args.overwrite)
    device, machine = set_up_device(args.device, args.threads)
    print(f"quality.py ({args.preset} preset) on {machine}; args: {vars(args)}", flush=True)
    started = time.time()
    results = {}

    def report_of(finished: bool) -> dict:
        return {
            "machine": machine,
            "torch": torch.__version__,
            "args": vars(args),
            "data": "synthetic" if args.synthetic else {"lm": GCIDE_PATH, "vit": FASHION_MNIST_DIR},
            "finished": finished,
            "wall_seconds": time.time() - started,
            **analyse(results),
            "results": results,
        }

    def save_partial(task_name, task_results):
        # after every trained model, so a run stopped early still leaves every finished record on disk
        results[task_name] = task_results
        write_json_atomic(json_path, report_of(finished=False))

    run = run_upcycle if args.upcycle else run_task
    for name, make_task in (("lm", lm_task), ("vit", vit_task)):
        if name in args.tasks:
            results[name] = run(make_task(args, device), args, lambda r, name=name: save_partial(name, r))
    report = report_of(finished=True)
    report["tables"] = tables(report)
    print("\n" + report["tables"], flush=True)
    write_json_atomic(json_path, report)
    written = [json_path] + ([] if args.no_plots else plot(report, results, args.out_dir, args.prefix))
    print(f"\nwrote {', '.join(written)} in {report['wall_seconds']:.0f}s total", flush=True)
    return report


if __name__ == "__main__":
    main()
