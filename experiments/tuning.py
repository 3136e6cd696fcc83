"""A tuning pass on the validation split, the same small budget for MHA, DAMCHA and DCMHA, before a comparison.

Two stages per task, each run one `experiments/quality.py` run of one seed (kept out of the comparison's seeds):

1. Learning rate: the task's preset rate times 0.5, 1 and 2 for MHA, DAMCHA and DCMHA (one run per rate, the three
   rows side by side on the same batches). Where a method's best rate is the grid's lowest or highest, the grid
   grows past that edge by a factor of 2, up to twice per side (times 1/8 to 8), until every method's best lies inside.
2. DAMCHA's generator, at DAMCHA's best rate of stage 1, one setting changed at a time from the default: hidden size
   half and twice, a learning-rate multiplier of 3 and 10 for the generator, and its own input LayerNorm.

Every choice reads the validation metric only (bits per byte on GCIDE's validation bytes; top-1 on Fashion-MNIST
training images held out from training): each method's rate is its best of stage 1, DAMCHA's generator setting the
best of stage 2 and of its stage-1 default. `--choose` writes `chosen.json`, the `--tuned` file of quality.py, and the
tables (`tuning.md`). A run whose JSON exists and finished is not run again.

    python experiments/tuning.py --task lm --out-dir experiments/tuning-pass
    python experiments/tuning.py --task vit --out-dir experiments/tuning-pass
    python experiments/tuning.py --choose --out-dir experiments/tuning-pass
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import atomic_write, write_json  # noqa: E402
from experiments import quality  # noqa: E402

TASKS = {
    # task: (quality.py arguments of the task's budget, the DAMCHA row tuned, validation metric, larger is better)
    "lm": (["--tasks", "lm", "--lm-steps", "1000", "--lm-eval-bytes", "65536"], "DAMCHA token", "validation_bpb", False),
    "vit": (["--tasks", "vit", "--vit-steps", "400", "--vit-validation-images", "5000", "--vit-test-images", "1000"],
            "DAMCHA sequence", "validation_top1", True),
}  # fmt: skip
LR_FACTORS = (1.0, 0.5, 2.0)  # the preset first: a tie keeps it
LR_EXTENSIONS = 2  # how many more halvings (doublings) the grid may take past its lowest (highest) factor
# DAMCHA's generator: (name, quality.py arguments given the preset's hidden size h)
GENERATOR_SETTINGS = {
    "hidden_half": lambda h: ["--metric-hidden-size", str(h // 2)],
    "hidden_double": lambda h: ["--metric-hidden-size", str(2 * h)],
    "generator_lr_x3": lambda h: ["--metric-lr-multiplier", "3"],
    "generator_lr_x10": lambda h: ["--metric-lr-multiplier", "10"],
    "input_layernorm": lambda h: ["--metric-input-norm", "layernorm"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), help="run the tuning pass of this task")
    parser.add_argument("--choose", action="store_true", help="read the finished runs, write chosen.json and tuning.md")
    parser.add_argument("--out-dir", required=True, help="where every run's JSON goes (and chosen.json)")
    parser.add_argument("--seed", type=int, default=10, help="the tuning seed (default 10, outside the comparisons')")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--synthetic", action="store_true", help="generated data (for the tests)")
    parser.add_argument("--tiny", action="store_true", help="quality.py's tiny preset (for the tests)")
    return parser


def preset(args) -> dict:
    return quality.PRESETS["tiny" if args.tiny else "quick"]


def common_arguments(args, task: str) -> list[str]:
    budget = TASKS[task][0]
    if args.tiny:  # the test's budget: the task only, tiny steps
        budget = ["--tasks", task] + (["--vit-validation-images", "100"] if task == "vit" else [])
    return ["--tiny" if args.tiny else "--quick", *budget, "--seeds", str(args.seed), "--threads", str(args.threads),
            "--no-plots", "--out-dir", args.out_dir, "--log-every", "50" if not args.tiny else "2",
            *(["--synthetic"] if args.synthetic else [])]  # fmt: skip


def rate_of(args, task: str, factor: float) -> float:
    return preset(args)[f"{task}_lr"] * factor


def run_once(arguments: list[str], out_dir: str, prefix: str, task: str, rate: float) -> dict:
    """The report of `quality.py <arguments> --prefix <prefix>`, from its JSON when a finished run at `rate` left one
    (a run at another rate, as a generator run left by an earlier choice of DAMCHA's rate, is run again)."""
    path = os.path.join(out_dir, f"{prefix}.json")
    if os.path.exists(path):
        with open(path) as file:
            report = json.load(file)
        if report.get("finished") and report["args"].get(f"{task}_lr") == rate:
            print(f"{prefix}: finished earlier, read from {path}", flush=True)
            return report
    return quality.main([*arguments, "--prefix", prefix, "--overwrite"])


def learning_rate_search(task: str, values_at: Callable[[float], dict]) -> dict[float, dict]:
    """{factor: {row: validation value}} over the grid `LR_FACTORS`, grown past an edge while a method's best factor
    lies on it (at most `LR_EXTENSIONS` times per side). `values_at(factor)` trains or reads that factor's run."""
    stage1 = {factor: values_at(factor) for factor in LR_FACTORS}
    rows = list(stage1[LR_FACTORS[0]])
    lowest, highest = min(LR_FACTORS) / 2**LR_EXTENSIONS, max(LR_FACTORS) * 2**LR_EXTENSIONS
    while True:
        bests = {best({f: values[row] for f, values in stage1.items()}, task) for row in rows}
        low, high = min(stage1), max(stage1)
        beyond = [f for edge, f, limit in ((low, low / 2, lowest), (high, high * 2, highest))
                  if edge in bests and (f >= limit if f < edge else f <= limit)]  # fmt: skip
        if not beyond:
            return stage1
        for factor in beyond:
            stage1[factor] = values_at(factor)


def validation(report: dict, task: str, row: str) -> float:
    (record,) = report["results"][task][row]
    return record[TASKS[task][2]]


def best(candidates: dict, task: str):
    """The key of the best validation value (lowest bits per byte, highest top-1)."""
    pick = max if TASKS[task][3] else min
    return pick(candidates, key=candidates.get)


def lr_prefix(task: str, rate: float) -> str:
    return f"{task}_lr_{rate:g}"


def tune(args, task: str) -> None:
    _, damcha_row, _, _ = TASKS[task]
    rows = ["MHA", damcha_row, "DCMHA"]
    base = common_arguments(args, task)

    def train(factor):
        rate = rate_of(args, task, factor)
        report = run_once([*base, "--rows", *rows, f"--{task}-lr", repr(rate)], args.out_dir, lr_prefix(task, rate),
                          task, rate)  # fmt: skip
        return {row: validation(report, task, row) for row in rows}

    stage1 = learning_rate_search(task, train)
    damcha_rate = rate_of(args, task, best({f: values[damcha_row] for f, values in stage1.items()}, task))
    hidden = preset(args)["metric_hidden_size"]
    for name, setting in GENERATOR_SETTINGS.items():
        run_once([*base, "--rows", damcha_row, f"--{task}-lr", repr(damcha_rate), *setting(hidden)], args.out_dir,
                 f"{task}_damcha_{name}", task, damcha_rate)  # fmt: skip


def choose(args) -> dict:
    """chosen.json and tuning.md from the finished runs of every task tuned in `out_dir`."""
    chosen, lines = {}, []
    hidden = preset(args)["metric_hidden_size"]
    for task, (_, damcha_row, _, larger_is_better) in TASKS.items():
        methods = {"MHA": "MHA", "DAMCHA": damcha_row, "DCMHA": "DCMHA"}
        reports = {}

        def read(factor, task=task, reports=reports, methods=methods):
            rate = rate_of(args, task, factor)
            reports[rate] = quality.read_reports([os.path.join(args.out_dir, lr_prefix(task, rate) + ".json")])[0]
            return {row: validation(reports[rate], task, row) for row in methods.values()}

        try:
            stage1 = learning_rate_search(task, read)
        except FileNotFoundError:  # this task's pass has not run (or not finished): nothing to choose
            continue
        factors = {rate_of(args, task, f): f for f in stage1}
        values = {m: {rate_of(args, task, f): v[row] for f, v in stage1.items()} for m, row in methods.items()}
        rates = {m: best(v, task) for m, v in values.items()}
        generator = {"default": values["DAMCHA"][rates["DAMCHA"]]}
        for name in GENERATOR_SETTINGS:
            report = quality.read_reports([os.path.join(args.out_dir, f"{task}_damcha_{name}.json")])[0]
            if report["args"].get(f"{task}_lr") != rates["DAMCHA"]:
                raise SystemExit(f"--choose: {task}_damcha_{name}.json ran at another rate than DAMCHA's best "
                                 f"({rates['DAMCHA']:g}); run --task {task} again")  # fmt: skip
            generator[name] = validation(report, task, damcha_row)
        setting = best(generator, task)
        damcha = {"metric_hidden_size": hidden, "metric_input_norm": "none", "metric_lr_multiplier": 1.0}
        damcha.update({
            "hidden_half": {"metric_hidden_size": hidden // 2}, "hidden_double": {"metric_hidden_size": 2 * hidden},
            "generator_lr_x3": {"metric_lr_multiplier": 3.0}, "generator_lr_x10": {"metric_lr_multiplier": 10.0},
            "input_layernorm": {"metric_input_norm": "layernorm"},
        }.get(setting, {}))  # fmt: skip
        chosen[task] = {"lr": rates, **damcha}
        scale, digits, unit = (100, 2, "validation top-1 %") if larger_is_better else (1, 3, "validation bits per byte")
        lines += [f"## {task}: {unit} (seed {reports[rates['MHA']]['args']['seeds'][0]}; "
                  f"{'higher' if larger_is_better else 'lower'} is better)", "",
                  "| learning rate | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]  # fmt: skip
        for rate in sorted(factors):
            cells = [
                f"{scale * values[m][rate]:.{digits}f}" + (" (chosen)" if rates[m] == rate else "") for m in methods
            ]
            lines.append(f"| {rate:g} ({factors[rate]:g}x) | " + " | ".join(cells) + " |")
        lines += ["", f"DAMCHA's generator at learning rate {rates['DAMCHA']:g}:", "",
                  "| setting | " + unit + " |", "|---|---|"]  # fmt: skip
        for name, value in generator.items():
            lines.append(f"| {name} | {scale * value:.{digits}f}" + (" (chosen)" if name == setting else "") + " |")
        lines.append("")
    if not chosen:
        raise SystemExit(f"--choose: no task has its three learning-rate runs in {args.out_dir}; run --task first")
    write_json(os.path.join(args.out_dir, "chosen.json"), chosen)
    atomic_write(os.path.join(args.out_dir, "tuning.md"), "\n".join(lines))
    print("\n".join(lines) + "\n" + json.dumps(chosen, indent=2))
    return chosen


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.task) == args.choose:
        parser.error("give either --task TASK (run its tuning pass) or --choose (read the runs)")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.choose:
        return choose(args)
    return tune(args, args.task)


if __name__ == "__main__":
    main()
