"""Quality of DAMCHA against vanilla multi-head attention and the paper's baselines on small real tasks.

Every row of a seed starts from that seed's MHA weights, sees the same batches and trains under the same schedule
(`damcha_hf.training`), so the rows are compared paired by seed. Each starts as MHA's function (DAMCHA's generator,
talking-heads' and DCMHA's mixing start as the identity, ColMHA at its full key width), except MoA, whose router keeps
its default top-k of the heads.

  lm:  byte-level GCIDE (`damcha_hf.data.read_gcide_bytes`): 10 MB train, the next 1 MB validation, the next 1 MB
       test; a small GPT-2; bits per byte. Rows: MHA, DAMCHA "token" and "query", and a row per other variant of
       `damcha_hf.modeling.variants` (talking_heads and DCMHA in eager attention, beside an eager MHA row).
  vit: Fashion-MNIST (`damcha_hf.data.read_fashion_mnist`), a small ViT (patch 4), test top-1.
       Rows: MHA, DAMCHA "sequence" and "token", and the same variant rows.
  The data: on Debian/Ubuntu, as root, `apt-get update && apt-get install -y dict-gcide dataset-fashion-mnist`;
  elsewhere $DAMCHA_GCIDE_PATH and --fashion-mnist-dir name copies; --synthetic trains on generated data instead.
  Every trained DAMCHA model is evaluated again with `metric_mask` "diagonal" and "offdiagonal" (no retraining).
  --upcycle: pretrain MHA, then continue it as MHA, converted to DAMCHA, and (--lora) LoRA on either.

Statistics: per pair of rows, the mean paired difference over seeds, its standard error, a two-sided 95% Student-t
interval (scipy) and how many seeds agree in sign; a claim of the paper's table is judged only where the interval
excludes zero ("confirmed" / "contradicted"; otherwise "not shown").

Writes `<out-dir>/<prefix>.json` (every number, per seed) and its figures. The default --out-dir is a new folder
`runs/quality/<prefix>-<UTC time>`: a run never replaces a file unless given that folder and --overwrite.

    python experiments/quality.py --quick --threads 1          # 30 steps per row: a smoke test
    python experiments/quality.py --tasks lm --lm-steps 2000 --seeds 0 1 2 --prefix lm_long
    python experiments/quality.py --upcycle --lora --tasks lm --pretrain-steps 400 --continue-steps 200
    python experiments/quality.py --merge a.json b.json --prefix merged     # runs of other seeds, pooled
    python experiments/quality.py --lengths lm_1000.json lm_5000.json      # the same rows trained longer
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

# The repository root, so that `experiments.common` imports when run as `python experiments/<script>.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf import data_sources  # noqa: E402  (standard library only)
from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402
from damcha_hf.modeling.metric_choices import METRIC_INPUT_NORMS  # noqa: E402  (imports nothing)
from damcha_hf.modeling.variants import VARIANTS  # noqa: E402  (torch-free)
from damcha_hf.optional_packages import check_extras  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import (  # noqa: E402  (torch-free: --help stays fast)
    CONFIDENCE,
    InputFileError,
    Row,
    count_parameters,
    fmt_paired,
    format_tables,
    gpt2_config_kwargs,
    gpt2_rows,
    json_kind,
    multiple_comparisons,
    multiple_comparisons_sentence,
    paired_statistics,
    read_json_input,
    save_figure_atomic,
    set_up_device,
    vit_config_kwargs,
    vit_rows,
    wrapped,
)

MB = 1_000_000
ABLATION_MASKS = ("diagonal", "offdiagonal")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# cross_head_variant -> row name: every baseline variant but plain attention, which the MHA row is.
BASELINE_VARIANTS = {name: variant.display_name for name, variant in VARIANTS.items() if name not in ("damcha", "none")}
TASK_CONTEXTS = {"lm": ("token", "query"), "vit": ("sequence", "token")}  # the DAMCHA rows' metric contexts
BATCH_SEED_OFFSET = {"lm": 1000, "vit": 2000}  # batches of seed s come from generator seed offset + s
CONTINUE_SEED_OFFSET = 3000  # the continuation batches of --upcycle: new data after the pretraining's

PRESETS = {
    # "full" is sized for about an hour on 2 CPU cores (about 0.3 s per LM step and 0.5 s per ViT step on one thread).
    # Evaluation reads `lm_eval_bytes` of the validation and test splits and `vit_test_images` test images.
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
DEFAULT_PREFIX = {"full": "quality", "quick": "quality_quick", "tiny": "quality_tiny"}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true",
                        help="small preset, 30 steps per row: a smoke test (a task trained under 100 steps judges no "
                        "claim of the paper)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="smallest preset, for the tests (seconds)")
    parser.add_argument("--synthetic", action="store_true", help="generated data instead of GCIDE / Fashion-MNIST")
    parser.add_argument("--fashion-mnist-dir", default=data_sources.FASHION_MNIST_DIR,
                        help="the folder of Fashion-MNIST's idx files (default: where Debian's dataset-fashion-mnist "
                        "puts them); the GCIDE dictionary is read from $DAMCHA_GCIDE_PATH, else Debian's dict-gcide")  # fmt: skip
    parser.add_argument("--tasks", nargs="+", default=["lm", "vit"], choices=["lm", "vit"])
    parser.add_argument("--seeds", type=int, nargs="+")
    for name in PRESETS["full"]:
        if name != "seeds":
            parser.add_argument(f"--{name.replace('_', '-')}", type=float if name.endswith("_lr") else int)
    parser.add_argument("--threads", type=positive_int, default=2,
                        help="torch CPU threads (default 2; 1 on a busy machine)")  # fmt: skip
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out-dir", help="where the JSON and figures go (default: runs/quality/<prefix>-<UTC time>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing <out-dir>/<prefix>.json")
    parser.add_argument("--prefix", help="output file prefix (default: quality, quality_quick or quality_tiny)")
    parser.add_argument("--no-baselines", action="store_true",
                        help=f"skip the baseline variants' rows ({', '.join(BASELINE_VARIANTS.values())})")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--parameter-matched-mha", action="store_true",
        help='add "MHA +params": MHA with MLPs widened to DAMCHA\'s parameter count (the capacity control)',
    )  # fmt: skip
    parser.add_argument(
        "--dcmha-matched-mha", action="store_true",
        help='add "MHA +DCMHA params": MHA with MLPs widened to DCMHA\'s parameter count',
    )  # fmt: skip
    parser.add_argument(
        "--scores-form", action="store_true",
        help='add "DAMCHA scores <context>" rows: the second reading of the metric (metric_form="scores", eager)',
    )  # fmt: skip
    parser.add_argument("--rows", nargs="+", help='run only these rows (e.g. "MHA +params"); default: all')
    tuning = parser.add_argument_group("tuning (for every task; --tuned sets them per task and method instead)")
    tuning.add_argument("--metric-input-norm", choices=METRIC_INPUT_NORMS,
                        help="the DAMCHA rows' metric_input_norm (default: none)")  # fmt: skip
    tuning.add_argument("--metric-lr-multiplier", type=float,
                        help="the DAMCHA rows' metric generators train at this multiple of the learning rate "
                        "(default 1)")  # fmt: skip
    tuning.add_argument("--vit-validation-images", type=int, default=0,
                        help="hold out the last N Fashion-MNIST training images as a validation split (not trained "
                        "on) and report validation_top1 on them (default 0: none)")  # fmt: skip
    tuning.add_argument("--tuned", metavar="JSON",
                        help="settings chosen by a tuning pass (experiments/tuning.py's chosen.json): per task, the "
                        "learning rate of each row (by row name, else its method's: MHA, DAMCHA, DCMHA; the other "
                        "rows take MHA's) and DAMCHA's "
                        "generator settings; replaces --lm-lr, --vit-lr, --metric-hidden-size, --metric-input-norm "
                        "and --metric-lr-multiplier")  # fmt: skip
    upcycle = parser.add_argument_group("upcycling (--upcycle): pretrain MHA, then continue as MHA or converted")
    upcycle.add_argument("--upcycle", action="store_true", help="run the upcycling experiment instead of the rows")
    upcycle.add_argument("--pretrain-steps", type=int, help="MHA pretraining steps (default: half the task's steps)")
    upcycle.add_argument("--continue-steps", type=int, help="continuation steps per arm (default: half the steps)")
    upcycle.add_argument("--lora", action="store_true", help="add LoRA arms: LoRA on MHA vs LoRA on converted DAMCHA")
    upcycle.add_argument("--lora-rank", type=int, default=8)
    reports = parser.add_argument_group("reports from earlier runs' JSON (no training)")
    reports.add_argument("--replot", metavar="JSON", help="recompute the statistics and redraw the tables and figures")
    reports.add_argument(
        "--merge", metavar="JSON", nargs="+", help="pool runs of the same settings but other seeds into one report"
    )
    reports.add_argument(
        "--lengths", metavar="JSON", nargs="+",
        help="compare runs of the same settings but other step counts, paired by seed",
    )  # fmt: skip
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_extras(parser, "experiments/quality.py", "experiments")  # the intervals: before minutes of training
    args.tuned_settings = None
    if args.tuned:
        replaced = [f"--{name.replace('_', '-')}" for name in TUNED_FLAGS if getattr(args, name) is not None]
        if replaced:
            parser.error(f"--tuned sets {', '.join(replaced)} per task; drop {replaced[0]} or drop --tuned")
        args.tuned_settings = read_tuned_settings(parser, args.tuned, args.tasks)
    args.metric_input_norm = args.metric_input_norm or "none"
    args.metric_lr_multiplier = 1.0 if args.metric_lr_multiplier is None else args.metric_lr_multiplier
    if not args.metric_lr_multiplier > 0:
        parser.error(f"--metric-lr-multiplier must be positive, got {args.metric_lr_multiplier}")
    if args.vit_validation_images < 0:
        parser.error(f"--vit-validation-images must be 0 or more, got {args.vit_validation_images}")
    args.preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in [*PRESETS["full"], "pretrain_steps", "continue_steps", "lora_rank"]:
        value = getattr(args, name)
        if name != "seeds" and value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.lm_width % args.lm_heads or args.vit_width % args.vit_heads:
        parser.error("--lm-heads must divide --lm-width and --vit-heads must divide --vit-width")
    if (args.lora or args.pretrain_steps or args.continue_steps) and not args.upcycle:
        parser.error("--lora, --pretrain-steps and --continue-steps belong to --upcycle; add --upcycle")
    if not (args.synthetic or args.replot or args.merge or args.lengths):
        check_data(parser, args)
    if args.rows and not (args.replot or args.merge or args.lengths):
        check_rows(parser, args)
    if args.prefix is None:
        args.prefix = DEFAULT_PREFIX[args.preset] + ("_upcycle" if args.upcycle else "")
    if args.out_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        args.out_dir = os.path.join(REPOSITORY, "runs", "quality", f"{args.prefix}-{stamp}")
    return args


TUNED_FILE = "an object of settings per task, as `experiments/tuning.py --choose` writes chosen.json"
REPORT_FILE = "a JSON report a quality.py run wrote"
REPORT_KEYS = ("args", "results")

# Methods that a tuning pass gives a learning rate of their own; every other row (the capacity controls and the
# untuned baselines, all converted from or widened MHA) trains at MHA's.
TUNED_METHODS = ("MHA", "DAMCHA", "DCMHA")
TUNED_FLAGS = ("lm_lr", "vit_lr", "metric_hidden_size", "metric_input_norm", "metric_lr_multiplier")


def read_tuned_settings(parser: argparse.ArgumentParser, path: str, tasks=("lm", "vit")) -> dict:
    """`{task: {"lr": {method: rate}, "metric_hidden_size": int, "metric_input_norm": str, "metric_lr_multiplier":
    float}}` from a tuning pass's JSON, every field checked (an error names the first one wrong), with settings for
    each of `tasks` (a task without them would train at the untuned preset while the run records the file)."""
    try:
        settings = read_json_input(path, "--tuned", holds=TUNED_FILE)
    except InputFileError as error:
        parser.error(str(error))
    untuned = [task for task in tasks if task not in settings]
    if untuned:
        held = f"settings for {' and '.join(sorted(settings))} only" if settings else "no task's settings"
        parser.error(f"--tuned {path}: holds {held}, none for --tasks {' '.join(untuned)}; run `experiments/tuning.py "
                     f"--task {untuned[0]}` and then `--choose`, or leave {' '.join(untuned)} out of --tasks")  # fmt: skip
    checks = {
        "metric_hidden_size": lambda v: isinstance(v, int) and v > 0,
        "metric_input_norm": lambda v: v in METRIC_INPUT_NORMS,
        "metric_lr_multiplier": lambda v: isinstance(v, (int, float)) and v > 0,
    }
    for task in settings:
        entry = settings.get(task) if task in ("lm", "vit") else None
        if not isinstance(entry, dict):
            found = f"{task!r}, {json_kind(entry)}" if task in ("lm", "vit") else repr(task)
            parser.error(f"--tuned {path}: expected an object with the tasks 'lm' and/or 'vit', found {found}")
        rates = entry.get("lr")
        if not isinstance(rates, dict) or any(
            not isinstance(rates.get(m), (int, float)) or rates[m] <= 0 for m in TUNED_METHODS
        ):
            parser.error(f"--tuned {path}: {task}.lr must give a positive rate for each of {', '.join(TUNED_METHODS)}")
        for field, valid in checks.items():
            if not valid(entry.get(field)):
                parser.error(f"--tuned {path}: {task}.{field} is missing or invalid ({entry.get(field)!r})")
    return settings


def check_rows(parser: argparse.ArgumentParser, args) -> None:
    """--rows names rows this run has (for one of its --tasks, with its flags): an unknown name would train nothing
    of it and still write results."""
    if args.upcycle:
        parser.error("--rows picks rows of the comparison; --upcycle trains its own arms (MHA, converted DAMCHA): "
                     "drop --rows or --upcycle")  # fmt: skip
    available = []
    for task in args.tasks:
        available += [name for name in row_names(args, task) if name not in available]
    unknown = [name for name in args.rows if name not in available]
    if unknown:
        parser.error(f"--rows {', '.join(map(repr, unknown))}: no such row of --tasks {' '.join(args.tasks)} with these "
                     f"flags; the rows are {', '.join(map(repr, available))}")  # fmt: skip


def row_names(args, task: str) -> list[str]:
    """The names of `task`'s rows with the run's flags (no model is built)."""
    if task == "lm":
        kwargs = gpt2_config_kwargs(args.lm_layers, args.lm_width, args.lm_heads, args.lm_context, vocab=256)
        rows = task_rows(gpt2_rows, kwargs, TASK_CONTEXTS["lm"], args, task_settings(args, "lm"))
    else:
        kwargs = vit_config_kwargs(28, 4, 1, args.vit_layers, args.vit_width, args.vit_heads, labels=10)
        rows = task_rows(vit_rows, kwargs, TASK_CONTEXTS["vit"], args, task_settings(args, "vit"))
    return [row.name for row in rows(args.seeds[0])]


def task_settings(args, task: str) -> dict:
    """The learning rate per method and DAMCHA's generator settings of `task`: the tuned ones, else the flags'."""
    if args.tuned_settings and task in args.tuned_settings:
        return args.tuned_settings[task]
    rate = getattr(args, f"{task}_lr")
    return {"lr": dict.fromkeys(TUNED_METHODS, rate), "metric_hidden_size": args.metric_hidden_size,
            "metric_input_norm": args.metric_input_norm, "metric_lr_multiplier": args.metric_lr_multiplier}  # fmt: skip


def method_of(row_name: str) -> str:
    """The tuned method whose learning rate a row trains at."""
    return next((m for m in TUNED_METHODS[1:] if row_name == m or row_name.startswith(f"{m} ")), "MHA")


# ----------------------------------------------------------------------------------------------------------- data


def check_data(parser: argparse.ArgumentParser, args) -> None:
    """The data of every task asked for is there (GCIDE holding the 12 MB the LM task reads), or one line naming what
    to install, before any model is built."""
    missing, packages, instead = [], [], []
    if "lm" in args.tasks:
        if data_sources.missing_gcide_message():
            missing.append(f"the lm task reads the GCIDE dictionary (not at {data_sources.gcide_path()})")
            packages.append("dict-gcide")
            instead.append(f"set {data_sources.GCIDE_PATH_VARIABLE} to a copy")
        else:
            try:
                with gzip.open(data_sources.gcide_path(), "rb") as handle:  # a dictd .dict.dz is gzip-compatible
                    held = len(handle.read(12 * MB))
            except (OSError, EOFError) as error:
                parser.error(f"{data_sources.gcide_path()} cannot be read as a gzip-compressed dictionary ({error})")
            if held < 12 * MB:
                parser.error(
                    f"{data_sources.gcide_path()} holds {held} bytes; the LM task reads 12 MB of GCIDE (10 train, 1 "
                    f"validation, 1 test): point {data_sources.GCIDE_PATH_VARIABLE} at the whole dictionary"
                )
    if "vit" in args.tasks:
        message = data_sources.missing_fashion_mnist_message(args.fashion_mnist_dir)
        if message:
            found = message.split("; ")[0].removeprefix("the Fashion-MNIST ")  # "folder <folder> does not exist"
            missing.append(f"the vit task reads Fashion-MNIST ({found})")
            packages.append("dataset-fashion-mnist")
            instead.append("pass --fashion-mnist-dir a folder of its idx files")
    if missing:
        install = f"apt-get update && apt-get install -y {' '.join(packages)}"
        parser.error(
            f"{' and '.join(missing)}: install {'them' if len(missing) > 1 else 'it'} (Debian/Ubuntu, as root: "
            f"`{install}`) or {' and '.join(instead)}, or pass --synthetic (generated data)"
        )


def load_gcide(eval_bytes: int, synthetic: bool, seed: int = 0):
    """(train, validation, test) byte tensors: GCIDE's first 10 MB, next 1 MB, next 1 MB (`eval_bytes` of each used)."""
    import torch

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
        from damcha_hf.data import read_gcide_bytes

        raw = read_gcide_bytes(data_sources.gcide_path(), 12 * MB)  # its size checked while parsing (`check_data`)
        split = (raw[: 10 * MB], raw[10 * MB : 11 * MB], raw[11 * MB : 12 * MB])
    train, validation, test = (torch.frombuffer(bytearray(part), dtype=torch.uint8).long() for part in split)
    return train, validation[:eval_bytes], test[:eval_bytes]


def load_fashion_mnist(synthetic: bool, seed: int = 0, folder: str = data_sources.FASHION_MNIST_DIR):
    """((train images, labels), (test images, labels)) from the idx files in `folder`; images float (N, 1, 28, 28),
    normalised."""
    import torch

    if synthetic:
        generator = torch.Generator().manual_seed(seed)
        prototypes = torch.rand(10, 28, 28, generator=generator) * 255

        def make(count):
            labels = torch.randint(0, 10, (count,), generator=generator)
            noise = torch.randn(count, 28, 28, generator=generator) * 60
            return (prototypes[labels] + noise).clamp(0, 255).to(torch.uint8), labels

        splits = [make(2000), make(500)]
    else:
        from damcha_hf.data import read_fashion_mnist

        splits = [[torch.tensor(array) for array in read_fashion_mnist(folder, split)] for split in ("train", "test")]
    return [(((images.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1), labels.long()) for images, labels in splits]


# ----------------------------------------------------------------------------------------------------- evaluation


def bits_per_byte(model, data, context: int, batch: int, device) -> float:
    """Non-overlapping windows: every byte after the first is predicted exactly once, from up to `context` bytes."""
    import torch
    import torch.nn.functional as F

    model.eval()
    windows = (len(data) - 1) // context
    inputs = data[: windows * context].view(windows, context)
    targets = data[1 : windows * context + 1].view(windows, context)
    total_nats, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, windows, batch):
            x, y = inputs[start : start + batch].to(device), targets[start : start + batch].to(device)
            logits = model(input_ids=x).logits.float()
            total_nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total_nats / count / math.log(2)


def top1(model, images, labels, batch: int, device) -> float:
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(images), batch):
            logits = model(pixel_values=images[start : start + batch].to(device)).logits
            correct += (logits.argmax(-1).cpu() == labels[start : start + batch]).sum().item()
    return correct / len(images)


def offdiagonal_share(matrix: list[list[float]]) -> float:
    """Frobenius norm of the off-diagonal part of C over that of the whole of C."""
    total = sum(value * value for row in matrix for value in row)
    return math.sqrt((total - sum(matrix[i][i] ** 2 for i in range(len(matrix)))) / total)


@contextlib.contextmanager
def with_metric_mask(model, mask: str):
    """Evaluate a trained DAMCHA model with another `metric_mask` (the paper's ablation)."""
    previous, model.config.metric_mask = model.config.metric_mask, mask
    try:
        yield
    finally:
        model.config.metric_mask = previous


# ---------------------------------------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """What the loops need of a task: its rows, its batches, its evaluation."""

    name: str  # "lm" or "vit"
    title: str
    steps: int
    lr: float
    contexts: tuple[str, ...]  # the DAMCHA rows' metric contexts
    rows: Callable[[int], list[Row]]  # seed -> rows, MHA first
    batches: Callable[[int, int], Callable[[int], dict]]  # (generator seed, steps) -> step -> batch
    evaluate: Callable[[object, str], dict]  # (trained model, metric-name prefix) -> metrics
    ablation_metric: str  # the metric evaluated again under each ablation mask
    metric_inputs: Callable[[], dict]  # one evaluation batch, for the mean cross-head matrix of each layer
    device: object
    settings: dict  # `task_settings`: the learning rate per method, DAMCHA's generator settings

    def learning_rate(self, row_name: str) -> float:
        rates = self.settings["lr"]  # a row's own rate (an equal-budget pass tunes every row), else its method's
        return rates[row_name] if row_name in rates else rates[method_of(row_name)]

    def lr_multipliers(self) -> dict[str, float] | None:
        multiplier = self.settings["metric_lr_multiplier"]
        return None if multiplier == 1 else {"cross_head_metric": multiplier}

    def ablate(self, model) -> dict:
        record = {}
        for mask in ABLATION_MASKS:
            with with_metric_mask(model, mask):
                record.update(self.evaluate(model, f"{mask}_", only=self.ablation_metric))
        return record


def baseline_rows(mha: Row, seed: int) -> list[Row]:
    """One row per baseline variant: the seed's MHA model converted, so every row shares the MHA row's weights and
    batches. Each starts as exactly MHA's function except MoA, whose router keeps its default top-k of the heads
    per token from the first step (its design; `convert_to_damcha` warns, and the warning is the expected one)."""

    def build(variant):
        def make():
            import torch

            from damcha_hf import convert_to_damcha
            from damcha_hf.modeling.cross_head_variant import InexactStartWarning

            reference = mha.build()
            torch.manual_seed(seed + 1)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=InexactStartWarning)  # MoA's sparse start, by design
                return convert_to_damcha(reference, cross_head_variant=variant).train()

        return make

    return [Row(name, build(variant), "variant") for variant, name in BASELINE_VARIANTS.items()]


def task_rows(builder, kwargs: dict, contexts: tuple, args, settings: dict) -> Callable[[int], list[Row]]:
    def rows(seed):
        built = builder(kwargs, contexts=contexts, metric_hidden_size=settings["metric_hidden_size"], seed=seed,
                        variants=False, parameter_matched_mha=args.parameter_matched_mha,
                        dcmha_matched_mha=args.dcmha_matched_mha, scores_form=args.scores_form,
                        damcha_options={"metric_input_norm": settings["metric_input_norm"]})  # fmt: skip
        return built if args.no_baselines else built + baseline_rows(built[0], seed)

    return rows


def lm_task(args, device) -> Task:
    import torch

    train_data, validation, test = load_gcide(args.lm_eval_bytes, args.synthetic)
    print(f"\n== byte-level LM on {'synthetic bytes' if args.synthetic else 'GCIDE'}: train {len(train_data)} bytes, "
          f"validation {len(validation)}, test {len(test)} ==", flush=True)  # fmt: skip
    kwargs = gpt2_config_kwargs(args.lm_layers, args.lm_width, args.lm_heads, args.lm_context, vocab=256)
    context = args.lm_context

    def batches(generator_seed, steps):
        generator = torch.Generator().manual_seed(generator_seed)
        starts = torch.randint(0, len(train_data) - context - 1, (steps, args.lm_batch), generator=generator)

        def next_batch(step):
            window = torch.stack([train_data[s : s + context] for s in starts[step].tolist()]).to(device)
            return {"input_ids": window, "labels": window}

        return next_batch

    def evaluate(model, prefix="", only=None):  # the ablations read the test split only: evaluation is costly on CPU
        splits = {"validation_bpb": validation, "test_bpb": test}
        return {prefix + name: bits_per_byte(model, data, context, 64, device) for name, data in splits.items()
                if only in (None, name)}  # fmt: skip

    settings = task_settings(args, "lm")
    return Task("lm", "LM", args.lm_steps, settings["lr"]["MHA"], TASK_CONTEXTS["lm"],
                task_rows(gpt2_rows, kwargs, TASK_CONTEXTS["lm"], args, settings), batches, evaluate, "test_bpb",
                lambda: {"input_ids": validation[: 8 * context].view(8, context).to(device)}, device,
                settings)  # fmt: skip


def vit_task(args, device) -> Task:
    import torch

    (train_x, train_y), (test_x, test_y) = load_fashion_mnist(args.synthetic, folder=args.fashion_mnist_dir)
    test_x, test_y = test_x[: args.vit_test_images], test_y[: args.vit_test_images]
    held_out = args.vit_validation_images
    if held_out >= len(train_x):
        raise ValueError(f"--vit-validation-images {held_out} leaves no training image of {len(train_x)}")
    validation_x, validation_y = train_x[len(train_x) - held_out :], train_y[len(train_y) - held_out :]
    train_x, train_y = train_x[: len(train_x) - held_out], train_y[: len(train_y) - held_out]
    print(f"\n== Fashion-MNIST{' (synthetic)' if args.synthetic else ''}: train {len(train_x)} images, "
          f"{f'validation {held_out}, ' if held_out else ''}test {len(test_x)} ==", flush=True)  # fmt: skip
    kwargs = vit_config_kwargs(28, 4, 1, args.vit_layers, args.vit_width, args.vit_heads, labels=10)

    def batches(generator_seed, steps):
        picks = torch.randint(0, len(train_x), (steps, args.vit_batch),
                              generator=torch.Generator().manual_seed(generator_seed))  # fmt: skip
        return lambda step: {"pixel_values": train_x[picks[step]].to(device), "labels": train_y[picks[step]].to(device)}

    def evaluate(model, prefix="", only=None):
        splits = {"test_top1": (test_x, test_y)}
        if held_out:
            splits["validation_top1"] = (validation_x, validation_y)
        return {prefix + name: top1(model, images, labels, 500, device) for name, (images, labels) in splits.items()
                if only in (None, name)}  # fmt: skip

    settings = task_settings(args, "vit")
    return Task("vit", "ViT", args.vit_steps, settings["lr"]["MHA"], TASK_CONTEXTS["vit"],
                task_rows(vit_rows, kwargs, TASK_CONTEXTS["vit"], args, settings), batches, evaluate, "test_top1",
                lambda: {"pixel_values": test_x[:64].to(device)}, device, settings)  # fmt: skip


def run_task(task: Task, args, on_record: Callable[[dict], None] = lambda results: None) -> dict:
    from damcha_hf.metric_map import compute_metric_map
    from damcha_hf.training import train

    results = {}
    for seed in args.seeds:
        for row in [row for row in task.rows(seed) if args.rows is None or row.name in args.rows]:
            next_batch = task.batches(BATCH_SEED_OFFSET[task.name] + seed, task.steps)  # same batches for every row
            model = row.build().to(task.device)
            started = time.time()
            lr = task.learning_rate(row.name)
            curve = train(model, next_batch, task.steps, lr, args.log_every, f"{task.title} {row.name} seed {seed}",
                          lr_multipliers=task.lr_multipliers() if row.kind == "damcha" else None)  # fmt: skip
            record = {"seed": seed, "lr": lr, "parameters": count_parameters(model), "curve": curve,
                      "step_seconds": (time.time() - started) / task.steps, **task.evaluate(model)}  # fmt: skip
            if row.kind == "damcha":
                record.update(task.ablate(model))
                record["mean_metric"] = compute_metric_map(model, task.metric_inputs()).matrices.tolist()
            results.setdefault(row.name, []).append(record)
            on_record(results)
    return results


def lora_wrap(model, rank: int):
    """LoRA as `recipes/finetune_lora.py` sets it up: its family's target modules, the cross-head modules (and a task
    head) trained in full, everything else frozen."""
    from peft import LoraConfig, get_peft_model

    from damcha_hf.families import family_of

    sys.path.insert(0, os.path.join(REPOSITORY, "recipes"))
    from finetune_lora import cross_head_modules  # the recipe's own choice of fully trained modules

    family = family_of(model)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(family.lora_target_modules),
        modules_to_save=cross_head_modules(model.config) + list(family.task_head_modules),
        fan_in_fan_out=family.lora_fan_in_fan_out, bias="none",
    )  # fmt: skip
    return get_peft_model(model, config)


def upcycle_arms(task: Task, lora_rank: int | None, metric_hidden_size: int) -> list[tuple[str, Callable]]:
    """(name, pretrained MHA -> model to continue) per arm; every arm starts from the pretrained function exactly."""
    from damcha_hf import convert_to_damcha

    def convert(**options):
        if options.get("cross_head_variant", "damcha") == "damcha":  # another variant refuses DAMCHA's fields
            options = {"metric_hidden_size": metric_hidden_size, **options}
        return lambda model: convert_to_damcha(model, **options)

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
    import torch

    from damcha_hf.training import train

    pretrain_steps = args.pretrain_steps or max(1, task.steps // 2)
    continue_steps = args.continue_steps or max(1, task.steps // 2)
    results = {}
    for seed in args.seeds:
        mha = task.rows(seed)[0]
        pretrained = mha.build().to(task.device)
        next_batch = task.batches(BATCH_SEED_OFFSET[task.name] + seed, pretrain_steps)
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
            results.setdefault(name, []).append({
                "seed": seed, "parameters": count_parameters(model),
                "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "step_seconds": (time.time() - started) / continue_steps, "curve": curve,
                "pretrain_curve": pretrain_curve, "pretrained": pretrained_metrics, **task.evaluate(model),
            })  # fmt: skip
            on_record(results)
    return results


# -------------------------------------------------------------------------------------------------------- reports

TASK_METRICS = {
    "lm": ["validation_bpb", "test_bpb"] + [f"{m}_test_bpb" for m in ABLATION_MASKS],
    "vit": ["validation_top1", "test_top1"] + [f"{m}_test_top1" for m in ABLATION_MASKS],
}
METRIC_FORMAT = {  # metric -> (label, scale, digits)
    "validation_bpb": ("val bpb", 1.0, 3), "test_bpb": ("test bpb", 1.0, 3), "test_top1": ("test top-1 points", 100.0, 2),
    "validation_top1": ("val top-1 points", 100.0, 2),
}  # fmt: skip
# Capacity controls: vanilla MHA widened to a method's parameter count, and the rows each one is the control for.
CAPACITY_CONTROLS = {"MHA +params": "DAMCHA ", "MHA +DCMHA params": "DCMHA"}
# The paper's table: (task, metric, row, reference, expected sign of row - reference, the paper's figures).
PAPER_CLAIMS = [
    ("lm", "test_bpb", "DAMCHA", "DCMHA", -1, "GPT-2 cross-entropy: DAMCHA 1.04 vs DCMHA 1.08"),
    ("vit", "test_top1", "DAMCHA", "DCMHA", +1, "ViT-S/16 top-1: DAMCHA 82.10% vs DCMHA 81.70%"),
    ("vit", "test_top1", "DAMCHA", "MHA", +1, "ViT-S/16 top-1: DAMCHA 82.10% vs MHA 79.51%"),
    ("vit", "test_top1", "DCMHA", "MHA", +1, "ViT-S/16 top-1: DCMHA 81.70% vs MHA 79.51%"),
]


# A task trained for fewer steps per row is a smoke test (the --quick and --tiny presets, 30 and 4 steps): it checks
# that the pipeline runs end to end, and its tables judge no claim of the paper.
SMOKE_TEST_STEPS = 100
NOT_JUDGED = "not judged: a smoke test"


def verdict(stats: dict, expected_sign: int, smoke_test: bool = False) -> str:
    """The verdict on a claim: "confirmed" if the interval lies on the side the paper's table predicts,
    "contradicted" if on the other side, "not shown" if it contains zero (or there are fewer than two seeds); none
    for a smoke test, whose tens of steps cannot speak to a claim about trained models."""
    if smoke_test:
        return NOT_JUDGED
    if stats.get("low") is None or stats["low"] <= 0 <= stats["high"]:
        return "not shown"
    return "confirmed" if (stats["low"] > 0) == (expected_sign > 0) else "contradicted"


def paired_differences(task_results: dict, row: str, reference: str, metric: str) -> list[float]:
    """row - reference of the same seed, for the seeds both have."""
    by_seed = {r["seed"]: r for r in task_results.get(reference, []) if metric in r}
    return [r[metric] - by_seed[r["seed"]][metric] for r in task_results.get(row, [])
            if metric in r and r["seed"] in by_seed]  # fmt: skip


def step_time_ratio(task_results: dict, row: str, reference: str) -> float | None:
    """Mean over seeds of row's seconds per training step over the reference's (same seed)."""
    by_seed = {r["seed"]: r for r in task_results.get(reference, []) if r.get("step_seconds")}
    ratios = [r["step_seconds"] / by_seed[r["seed"]]["step_seconds"] for r in task_results.get(row, [])
              if r.get("step_seconds") and r["seed"] in by_seed]  # fmt: skip
    return sum(ratios) / len(ratios) if ratios else None


def comparison_pairs(rows: list[str]) -> list[tuple[str, str]]:
    """Every row against MHA, every baseline against every DAMCHA row (DAMCHA - baseline), each method against
    the MHA widened to its parameter count, when that control ran, and the second reading of the metric against the
    first in the same context ("DAMCHA scores token" - "DAMCHA token")."""
    damcha = [r for r in rows if r.startswith(("DAMCHA", "LoRA DAMCHA"))]
    baselines = [r for r in rows if r in BASELINE_VARIANTS.values()]
    pairs = [(r, "MHA") for r in rows if r != "MHA" and "MHA" in rows and not r.startswith("LoRA")]
    pairs += [(d, b) for d in damcha for b in baselines]
    pairs += [(r, control) for control, prefix in CAPACITY_CONTROLS.items() if control in rows
              for r in rows if r.startswith(prefix)]  # fmt: skip
    pairs += [(r, r.replace("DAMCHA scores ", "DAMCHA ")) for r in rows
              if r.startswith("DAMCHA scores ") and r.replace("DAMCHA scores ", "DAMCHA ") in rows]  # fmt: skip
    if "LoRA MHA" in rows:
        pairs += [(r, "LoRA MHA") for r in rows if r.startswith("LoRA DAMCHA")]
    return pairs


def compare(task_results: dict, metrics: list[str]) -> list[dict]:
    """The paired statistics of every comparison pair, per metric, with the step-time ratio of the pair."""
    return [{"row": row, "reference": reference, "metric": metric,
             "step_time_ratio": step_time_ratio(task_results, row, reference), **paired_statistics(differences)}
            for row, reference in comparison_pairs(list(task_results)) for metric in metrics
            if (differences := paired_differences(task_results, row, reference, metric))]  # fmt: skip


def paper_verdicts(comparisons_per_task: dict, smoke_tests=()) -> list[dict]:
    """Each claim of the paper's table, per DAMCHA row that ran, judged on its paired interval (not for the tasks of
    `smoke_tests`)."""
    return [{"task": task, "claim": claim, "row": c["row"], "reference": reference, "metric": metric,
             "verdict": verdict(c, sign, task in smoke_tests),
             **{k: c[k] for k in ("n", "mean", "se", "low", "high", "agree_in_sign")}}
            for task, metric, row, reference, sign, claim in PAPER_CLAIMS for c in comparisons_per_task.get(task, [])
            if c["metric"] == metric and c["reference"] == reference
            and (c["row"] == row or (row == "DAMCHA" and c["row"].startswith("DAMCHA ")))]  # fmt: skip


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(task_results: dict, metrics: list[str]) -> dict:
    """Per row and metric: mean, sample std, per-seed values, the paired difference to MHA (same seed, the unmasked
    metric) and the mean seconds per training step; the mean off-diagonal share of C per layer."""
    reference = {r["seed"]: r for r in task_results.get("MHA", [])}
    summary = {}
    for row, records in task_results.items():
        entry = {"parameters": records[0]["parameters"]}
        steps = [r["step_seconds"] for r in records if r.get("step_seconds")]
        if steps:
            entry["step_seconds"] = sum(steps) / len(steps)
        for metric in metrics:
            values = [r[metric] for r in records if metric in r]
            if values:
                entry[metric] = {**mean_std(values), "per_seed": values}
                base = metric.split("_", 1)[1] if metric.startswith(ABLATION_MASKS) else metric
                paired = [r[metric] - reference[r["seed"]][base] for r in records
                          if metric in r and r["seed"] in reference]  # fmt: skip
                if paired and row != "MHA":
                    entry[metric]["paired_diff_vs_mha"] = paired_statistics(paired)
        shares = [[offdiagonal_share(layer) for layer in r["mean_metric"]] for r in records if r.get("mean_metric")]
        if shares:
            entry["offdiagonal_share_per_layer"] = [sum(column) / len(column) for column in zip(*shares)]
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
        for step in sorted({logged[max(0, round(len(logged) * (i + 1) / points) - 1)] for i in range(points)}):
            differences = [(dict(r["curve"])[step] - curves[r["seed"]][step]) / unit for r in records
                           if step in dict(r["curve"]) and step in curves[r["seed"]]]  # fmt: skip
            if differences:
                gaps.append({"row": row, "reference": reference, "step": step, **paired_statistics(differences)})
    return gaps


def smoke_tests(run_args: dict) -> set[str]:
    """The tasks a run trained for fewer than SMOKE_TEST_STEPS steps per row (pretraining and continuation together
    for --upcycle)."""
    upcycle = run_args.get("upcycle") and run_args.get("pretrain_steps") and run_args.get("continue_steps")
    steps = {task: run_args["pretrain_steps"] + run_args["continue_steps"] if upcycle else run_args.get(f"{task}_steps")
             for task in run_args.get("tasks", ())}  # fmt: skip
    return {task for task, count in steps.items() if count is not None and count < SMOKE_TEST_STEPS}


def analyse(results: dict, smoke_tests=()) -> dict:
    """summary (per task and row), comparisons (per task), the verdicts on the paper's claims (none for the tasks of
    `smoke_tests`) and the training gaps."""
    comparisons = {task: compare(rows, [m for m in TASK_METRICS[task] if not m.startswith(ABLATION_MASKS)])
                   for task, rows in results.items()}  # fmt: skip
    # one family per task and metric: the comparisons a reader scans together in one column
    families = {task: {metric: multiple_comparisons([c for c in items if c["metric"] == metric])
                       for metric in dict.fromkeys(c["metric"] for c in items)}
                for task, items in comparisons.items()}  # fmt: skip
    return {"summary": {task: summarise(rows, TASK_METRICS[task]) for task, rows in results.items()},
            "comparisons": comparisons, "multiple_comparisons": families,
            "paper_verdicts": paper_verdicts(comparisons, smoke_tests),
            "training_gaps": {task: gap_over_training(rows, math.log(2) if task == "lm" else 1.0)
                              for task, rows in results.items()}}  # fmt: skip


def fmt(entry: dict, metric: str, scale: float = 1.0, digits: int = 3) -> str:
    value = entry.get(metric)
    return f"{scale * value['mean']:.{digits}f} ± {scale * value['std']:.{digits}f}" if value else "-"


def tables(report: dict) -> str:
    # the seeds that finished (a partial report lists more in its arguments than it has records for)
    seeds = sorted({r["seed"] for rows in report["results"].values() for records in rows.values() for r in records})
    upcycle = report["args"].get("upcycle")
    out = []
    for task, title, unit, metric, scale, digits, headers in (
        ("lm", "Byte-level LM", "bits per byte", "test_bpb", 1, 3,
         ["val bpb", "test bpb", "test Δ vs MHA (paired)", "diagonal-only test bpb", "off-diagonal-only test bpb"]),
        ("vit", "Fashion-MNIST ViT", "test top-1", "test_top1", 100, 2,
         ["test top-1 %", "Δ vs MHA (paired, points)", "diagonal-only top-1 %", "off-diagonal-only top-1 %"]),
    ):  # fmt: skip
        if task not in report["summary"]:
            continue
        before = ["validation_bpb", metric] if task == "lm" else [metric]
        rows = [[row, f"{e['parameters'] / 1e6:.3f}M", f"{1000 * e['step_seconds']:.0f}" if e.get("step_seconds") else "-",
                 *[fmt(e, m, scale, digits) for m in before],
                 fmt_paired(e.get(metric, {}).get("paired_diff_vs_mha"), scale, digits),
                 *[fmt(e, f"{mask}_{metric}", scale, digits) for mask in ABLATION_MASKS]]
                for row, e in report["summary"][task].items()]  # fmt: skip
        if upcycle:
            title = f"Upcycled {title.replace('Byte', 'byte')} (after continuing)"
        out.append(
            wrapped(f"### {title} ({unit}, mean ± std over seeds {seeds})")
            + "\n\n"
            + format_tables(["row", "params", "ms/step", *headers], rows)
        )
    comparisons = [[task, f"{c['row']} − {c['reference']}", METRIC_FORMAT[c["metric"]][0],
                    fmt_paired(c, *METRIC_FORMAT[c["metric"]][1:]),
                    "-" if c.get("p_holm") is None else f"{c['p_holm']:.3f}",
                    "-" if c["step_time_ratio"] is None else f"{c['step_time_ratio']:.2f}x"]
                   for task, items in report.get("comparisons", {}).items() for c in items]  # fmt: skip
    if comparisons:
        families = [f"{task}, {METRIC_FORMAT[metric][0]}: {multiple_comparisons_sentence(family)}"
                    for task, by_metric in report.get("multiple_comparisons", {}).items()
                    for metric, family in by_metric.items()]  # fmt: skip
        out.append(
            wrapped(f"### Paired differences (mean ± standard error over seeds [two-sided {100 * CONFIDENCE:.0f}% "
                    "Student-t interval, n-1 df] (seeds agreeing in sign / seeds); Holm p: the paired t-test's "
                    "p-value adjusted for every comparison of its task and metric; step time: row's seconds per step "
                    "over the reference's, same seed)")
            + "\n\n"
            + format_tables(["task", "difference", "metric", "paired difference", "Holm p", "step time"], comparisons,
                            keys=2)
            + "".join("\n\n" + wrapped(sentence) for sentence in families)
        )  # fmt: skip
    gaps = {}
    for task, items in report.get("training_gaps", {}).items():
        for gap in items:
            gaps.setdefault((task, gap["row"], gap["reference"]), {})[gap["step"]] = gap
    if gaps:
        steps = sorted({step for by_step in gaps.values() for step in by_step})
        out.append(wrapped("### Paired training-loss gap over training (row − reference, same batches; LM in bits per "
                           "byte, ViT in nats; mean ± SE [95% t] (agree/n) over the logging window ending at each "
                           "step)") + "\n\n"
                   + format_tables(["task", "difference"] + [f"step {s}" for s in steps],
                                   [[task, f"{row} − {ref}"] + [fmt_paired(by_step.get(s)) for s in steps]
                                    for (task, row, ref), by_step in gaps.items()], keys=2))  # fmt: skip
    verdicts = [[f"{v['task']}: {v['row']} − {v['reference']}", fmt_paired(v, *METRIC_FORMAT[v["metric"]][1:]),
                 v["verdict"], v["claim"]] for v in report.get("paper_verdicts", [])]  # fmt: skip
    if verdicts and not upcycle:
        smoke = (
            f" (a task trained under {SMOKE_TEST_STEPS} steps is a smoke test: it judges none)"
            if any(v["verdict"] == NOT_JUDGED for v in report.get("paper_verdicts", []))
            else ""
        )
        out.append(wrapped(f"### Against the paper's table (a claim only where the interval excludes zero){smoke}")
                   + "\n\n"
                   + format_tables(["here", "paired difference [95% t interval] (agree/n)", "verdict", "paper"],
                                   verdicts))  # fmt: skip
    shares = [[f"{task} {name}", ", ".join(f"{v:.3f}" for v in entry["offdiagonal_share_per_layer"])]
              for task, summary in report["summary"].items() for name, entry in summary.items()
              if "offdiagonal_share_per_layer" in entry]  # fmt: skip
    if shares:
        out.append("### Off-diagonal share of the mean C (||offdiag|| / ||C||, per layer, mean over seeds)\n\n"
                   + format_tables(["model", "per layer"], shares))  # fmt: skip
    return "\n\n".join(out)


def plot(report: dict, out_dir: str, prefix: str) -> list[str]:
    """`<prefix>_loss_curves.png` (mean training loss per row, and each row's paired difference to MHA) and
    `<prefix>_metric_heatmap.png` (the mean C per layer of the first seed's DAMCHA models)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, paths = report["results"], []
    tasks = [t for t in ("lm", "vit") if t in results]
    figure, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7.5), squeeze=False, layout="constrained")
    for column, task in enumerate(tasks):
        unit = math.log(2) if task == "lm" else 1.0  # bits per byte for the LM, nats for the classifier
        reference = {r["seed"]: r["curve"] for r in results[task].get("MHA", [])}
        axis, difference_axis = axes[0][column], axes[1][column]
        for row, records in results[task].items():
            steps = [s for s, _ in records[0]["curve"]]
            axis.plot(steps, [sum(r["curve"][i][1] for r in records) / len(records) / unit for i in range(len(steps))],
                      label=row)  # fmt: skip
            paired = [r for r in records if r["seed"] in reference]
            if paired:  # row - MHA of the same seed: the paired view, which the seed-to-seed spread does not blur
                difference_axis.plot(steps, [sum(r["curve"][i][1] - reference[r["seed"]][i][1] for r in paired)
                                             / len(paired) / unit for i in range(len(steps))], label=row)  # fmt: skip
        axis.set_ylabel("train bits per byte" if task == "lm" else "train cross-entropy")
        axis.set_title(f"{'Byte-level LM (GCIDE)' if task == 'lm' else 'ViT on Fashion-MNIST'}, mean over seeds")
        axis.set_yscale("log")
        difference_axis.axhline(0.0, color="black", linewidth=0.8)
        difference_axis.set_ylabel("row - MHA, same seed" + (" (bits per byte)" if task == "lm" else ""))
        difference_axis.set_title("paired difference to MHA (negative = better), mean over seeds", fontsize=9)
        for ax in (axis, difference_axis):
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    paths.append(os.path.join(out_dir, f"{prefix}_loss_curves.png"))
    save_figure_atomic(figure, paths[-1])
    plt.close(figure)

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
        paths.append(os.path.join(out_dir, f"{prefix}_metric_heatmap.png"))
        save_figure_atomic(figure, paths[-1])
        plt.close(figure)
    return paths


def read_reports(paths: list[str], flag: str, keys: tuple[str, ...] = REPORT_KEYS) -> list[dict]:
    """The reports in `paths`, the files of `flag`; a missing, damaged or foreign file raises `InputFileError`."""
    return [read_json_input(path, flag, holds=REPORT_FILE, keys=keys) for path in paths]


# Arguments that do not change what a run measures: runs that differ only in these may be merged or compared.
RUN_SETTINGS_IGNORED = {
    "seeds", "tasks", "prefix", "out_dir", "threads", "merge", "replot", "no_plots", "device", "rows",
    "parameter_matched_mha", "dcmha_matched_mha", "scores_form", "overwrite", "no_baselines", "lengths", "tuned",
}  # fmt: skip


def write_report(report: dict, out_dir: str, prefix: str, overwrite: bool, plots: bool) -> dict:
    json_path = os.path.join(out_dir, f"{prefix}.json")
    refuse_to_overwrite(json_path, overwrite)
    write_json(json_path, report)
    print("wrote:\n" + "\n".join(f"  {path}" for path in [json_path] + (plot(report, out_dir, prefix)
                                                                     if plots and "results" in report else [])))  # fmt: skip
    return report


def merge(paths: list[str], out_dir: str, prefix: str, overwrite: bool = False, plots: bool = True) -> dict:
    """One report from several runs that differ only in their seeds (and tasks): the seeds' records are pooled."""
    reports = read_reports(paths, "--merge", keys=(*REPORT_KEYS, "machine", "torch", "data", "wall_seconds"))
    settings = [{k: v for k, v in r["args"].items() if k not in RUN_SETTINGS_IGNORED} for r in reports]
    for path, setting in zip(paths[1:], settings[1:]):
        differing = sorted(k for k in setting if setting[k] != settings[0].get(k))
        if differing:
            raise InputFileError(f"--merge: {path} was run with other settings than {paths[0]}: {', '.join(differing)}")
    results: dict = {}
    for report in reports:
        for task, rows in report["results"].items():
            for row, records in rows.items():
                pooled = results.setdefault(task, {}).setdefault(row, [])
                duplicate = {r["seed"] for r in pooled} & {r["seed"] for r in records}
                if duplicate:
                    raise InputFileError(f"--merge: seed(s) {sorted(duplicate)} of {task} {row} appear in two runs")
                pooled.extend(records)
    all_seeds = sorted({r["seed"] for rows in results.values() for records in rows.values() for r in records})
    report = {"machine": reports[0]["machine"], "torch": reports[0]["torch"],
              "args": {**reports[0]["args"], "seeds": all_seeds, "prefix": prefix, "merged_from": paths},
              "data": reports[0]["data"], "wall_seconds": sum(r["wall_seconds"] for r in reports),
              **analyse(results, smoke_tests(reports[0]["args"])), "results": results}  # fmt: skip
    report["tables"] = tables(report)
    print(report["tables"])
    return write_report(report, out_dir, prefix, overwrite, plots)


LENGTH_METRIC = {"lm": "test_bpb", "vit": "test_top1"}  # the metric by which training lengths are compared


def training_lengths(paths: list[str], out_dir: str, prefix: str, overwrite: bool = False) -> dict:
    """Runs of the same settings but the task's step count (each possibly a `--merge`), compared on the seeds every
    run has. A seed's runs share their starting weights and the order of their batches (a longer run sees the
    shorter run's batches first), so MHA's change from one length to the next is paired by seed, as is every row's
    difference to MHA at each length."""
    reports = read_reports(paths, "--lengths")
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
                raise InputFileError(f"--lengths: {path} differs from {paths[0]} in more than its steps: "
                                     f"{', '.join(differing)}")  # fmt: skip
        ordered = sorted(reports, key=lambda r: r["args"][f"{task}_steps"])
        steps = [r["args"][f"{task}_steps"] for r in ordered]
        if len(set(steps)) != len(steps):
            raise InputFileError(f"--lengths: two runs train {task} for the same number of steps ({steps})")
        rows = [row for row in ordered[0]["results"][task] if all(row in r["results"][task] for r in ordered)]
        if "MHA" not in rows:
            raise InputFileError(f"--lengths: every run needs an MHA row for {task}")
        seeds = sorted(set.intersection(*({rec["seed"] for row in rows for rec in r["results"][task][row]}
                                          for r in ordered)))  # fmt: skip
        by_length, previous = [], None
        for report, length in zip(ordered, steps):
            values = {row: {rec["seed"]: rec[metric] for rec in report["results"][task][row] if rec["seed"] in seeds}
                      for row in rows}  # fmt: skip
            mha = values["MHA"]
            entry = {"steps": length, "seeds": seeds, "mha": mean_std(list(mha.values()))}
            if previous is not None:
                entry["mha_change"] = paired_statistics([mha[s] - previous[1][s] for s in seeds])
                entry["mha_change_per_doubling"] = entry["mha_change"]["mean"] / math.log2(length / previous[0])
            entry["vs_mha"] = {row: paired_statistics([values[row][s] - mha[s] for s in seeds if s in values[row]])
                               for row in rows if row != "MHA"}  # fmt: skip
            by_length.append(entry)
            previous = (length, mha)
        comparison[task] = {"metric": metric, "rows": rows, "by_length": by_length}
    if not comparison:
        raise InputFileError("--lengths: the runs share no task")
    report = {"args": {"lengths": paths, "prefix": prefix}, "lengths": comparison,
              "tables": length_tables(comparison)}  # fmt: skip
    print(report["tables"])
    return write_report(report, out_dir, prefix, overwrite, plots=False)


def length_tables(comparison: dict) -> str:
    out = []
    for task, entry in comparison.items():
        label, scale, digits = METRIC_FORMAT[entry["metric"]]
        others = [row for row in entry["rows"] if row != "MHA"]
        headers = ["steps", f"MHA {label}", "MHA change from the previous length (paired)", "per doubling of steps"]
        rows = [[str(length["steps"]), fmt(length, "mha", scale, digits),
                 fmt_paired(length.get("mha_change"), scale, digits),
                 f"{scale * length['mha_change_per_doubling']:+.{digits}f}" if "mha_change" in length else "-"]
                + [fmt_paired(length["vs_mha"][row], scale, digits) for row in others]
                for length in entry["by_length"]]  # fmt: skip
        out.append(
            wrapped(
                f"### {task}: {label} by training length (paired over seeds {entry['by_length'][0]['seeds']}: "
                "mean ± SE [95% t] (agree/n))"
            )
            + "\n\n"
            + format_tables(headers + [f"{r} − MHA" for r in others], rows)
        )
    return "\n\n".join(out)


def refuse_to_overwrite(json_path: str, overwrite: bool) -> None:
    if os.path.exists(json_path) and not overwrite:
        raise SystemExit(
            f"quality.py: {json_path} exists; pass --overwrite to replace it, or another --out-dir / --prefix."
        )


def main(argv=None):
    args = parse_args(argv)
    try:
        return run_reports(args) if args.replot or args.merge or args.lengths else run(args)
    except InputFileError as error:  # one line naming the file, not a traceback
        raise SystemExit(f"quality.py: error: {error}") from None


def run_reports(args) -> dict:
    """--replot, --merge or --lengths: reports from earlier runs' JSON, no training."""
    if args.replot:
        report = read_reports([args.replot], "--replot")[0]
        # recomputed, so older reports get the current statistics
        report.update(analyse(report["results"], smoke_tests(report["args"])))
        print(tables(report))
        figures = plot(report, args.out_dir, os.path.splitext(os.path.basename(args.replot))[0])
        print("wrote:\n" + "\n".join(f"  {path}" for path in figures))
        return report
    if args.merge:
        return merge(args.merge, args.out_dir, args.prefix, args.overwrite, plots=not args.no_plots)
    return training_lengths(args.lengths, args.out_dir, args.prefix, args.overwrite)


def run(args) -> dict:
    json_path = os.path.join(args.out_dir, f"{args.prefix}.json")
    refuse_to_overwrite(json_path, args.overwrite)
    import torch

    device, machine = set_up_device(args.device, args.threads)
    args.device = str(device)
    print(wrapped(f"quality.py ({args.preset} preset) on {machine}; args: {vars(args)}"), flush=True)
    started, results = time.time(), {}

    def report_of(finished: bool) -> dict:
        return {
            "machine": machine,
            "torch": torch.__version__,
            "args": vars(args),
            "data": "synthetic" if args.synthetic else {"lm": data_sources.gcide_path(), "vit": args.fashion_mnist_dir},
            "finished": finished,
            "wall_seconds": time.time() - started,
            **analyse(results, smoke_tests(vars(args))),
            "results": results,
        }

    def save_partial(task_name, task_results):
        # after every trained model, so a run stopped early still leaves every finished record on disk
        results[task_name] = task_results
        write_json(json_path, report_of(finished=False))

    run = run_upcycle if args.upcycle else run_task
    for name, make_task in (("lm", lm_task), ("vit", vit_task)):
        if name in args.tasks:
            results[name] = run(make_task(args, device), args, lambda r, name=name: save_partial(name, r))
    report = report_of(finished=True)
    report["tables"] = tables(report)
    print("\n" + report["tables"], flush=True)
    write_report(report, args.out_dir, args.prefix, overwrite=True, plots=not args.no_plots)
    print(f"done in {report['wall_seconds']:.0f}s total", flush=True)
    return report


if __name__ == "__main__":
    main()
