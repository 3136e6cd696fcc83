"""An equal-budget tuning pass on the validation split, before a comparison: every method gets the same learning-rate
grid and the same seeds, and nothing else.

Every run is one `experiments/quality.py` run of one seed at one learning rate, training every row side by side on
the same batches: MHA, DAMCHA in each context the task reports (LM `"token"` and `"query"`, ViT `"sequence"` and
`"token"`), talking-heads, DCMHA, ColMHA, MoA, and the capacity controls (MHA widened to DAMCHA's and to DCMHA's
parameter count). So every method is trained at every rate of the grid on every tuning seed, the budget of each:

- one log-spaced grid of 6 rates (factors of 2 of the task's preset rate: LM 1/4 to 8, ViT 1/8 to 4), grown by a
  factor of 2 past an edge where a method's best (mean validation over the seeds) lies on it, up to twice per side;
- every rate on every tuning seed (default 10, 11, 12: three seeds, none of them a comparison seed);
- each method's rate chosen by its mean validation over the seeds (bits per byte on GCIDE's validation bytes, lowest;
  top-1 on Fashion-MNIST training images held out of training, highest).

A method's own hyperparameters (DAMCHA's generator width and rate, DCMHA's rank, MoA's top-k, ColMHA's width) get no
extra configurations, for any method: each stays at its default. Equal extra configurations would multiply the pass by
(1 + k) for k settings per method, past what 2 CPU cores allow, and a setting searched on the tuning seeds for one
method only is the unequal budget this pass replaces.

Every run's JSON is kept: `<task>_lr<rate>_seed<seed>.json`, read again when it finished at the same settings; a file
of that name left by another run (unfinished, or other settings) is never replaced, the new run takes the next free
name (`..._run2.json`, ...). Each JSON records the torch version and the thread count (`torch`, `machine`,
`args.threads`). `--choose` writes `chosen.json` (each row's rate: the `--tuned` file of quality.py) and `tuning.md`;
`python experiments/report.py --figures-only --tuning-dir DIR` draws the learning-rate curves (mean ± s.e.).

    python experiments/tuning.py --task lm --out-dir experiments/equal-budget-tuning
    python experiments/tuning.py --task vit --out-dir experiments/equal-budget-tuning
    python experiments/tuning.py --choose --out-dir experiments/equal-budget-tuning
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import atomic_write, write_json  # noqa: E402
from experiments import quality  # noqa: E402
from experiments.common import InputFileError  # noqa: E402

TASKS = {
    # task: (quality.py arguments of the task's budget, the DAMCHA row of the generic "DAMCHA" rate, validation metric,
    # larger is better). Half the steps of the earlier passes (LM 1,000, ViT 400): the whole pass, tuning and the
    # 8-seed comparison, then runs on one machine in about an hour, so no comparison mixes CPUs that round differently.
    "lm": (["--tasks", "lm", "--lm-steps", "500", "--lm-eval-bytes", "65536"], "DAMCHA token", "validation_bpb", False),
    "vit": (["--tasks", "vit", "--vit-steps", "200", "--vit-validation-images", "5000", "--vit-test-images", "1000"],
            "DAMCHA sequence", "validation_top1", True),
}  # fmt: skip
# The grid: the preset rate times 2^k. Six points per task, placed around where the earlier one-seed pass found the
# methods' best rates (LM 6e-3 to 1.2e-2 of a 3e-3 preset; ViT 5e-4 to 2e-3 of a 2e-3 preset).
GRID_EXPONENTS = {"lm": (-2, -1, 0, 1, 2, 3), "vit": (-3, -2, -1, 0, 1, 2)}
LR_EXTENSIONS = 2  # how many more halvings (doublings) the grid may take past its lowest (highest) point
MINIMUM_SEEDS = 3
DEFAULT_SEEDS = (10, 11, 12)  # outside every comparison's seeds (0 to 7)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), help="run the tuning pass of this task")
    parser.add_argument("--choose", action="store_true", help="read the finished runs, write chosen.json and tuning.md")
    parser.add_argument("--out-dir", required=True, help="where every run's JSON goes (and chosen.json)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS),
                        help=f"the tuning seeds, at least {MINIMUM_SEEDS} (default 10 11 12, outside the comparisons')")  # fmt: skip
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads of each run")
    parser.add_argument("--synthetic", action="store_true", help="generated data (for the tests)")
    parser.add_argument("--tiny", action="store_true", help="quality.py's tiny preset (for the tests)")
    return parser


def preset(args) -> dict:
    return quality.PRESETS["tiny" if args.tiny else "quick"]


def common_arguments(args, task: str) -> list[str]:
    budget = TASKS[task][0]
    if args.tiny:  # the test's budget: the task only, tiny steps
        budget = ["--tasks", task] + (["--vit-validation-images", "100"] if task == "vit" else [])
    return ["--tiny" if args.tiny else "--quick", *budget, "--threads", str(args.threads), "--no-plots",
            "--parameter-matched-mha", "--dcmha-matched-mha", "--out-dir", args.out_dir,
            "--log-every", "50" if not args.tiny else "2", *(["--synthetic"] if args.synthetic else [])]  # fmt: skip


def grid(task: str) -> list[float]:
    """The starting grid's factors of the preset rate, lowest first."""
    return [2.0**k for k in GRID_EXPONENTS[task]]


def rate_of(args, task: str, factor: float) -> float:
    return preset(args)[f"{task}_lr"] * factor


def run_name(task: str, rate: float, seed: int) -> str:
    return f"{task}_lr{rate:g}_seed{seed}"


def same_settings(report: dict, arguments: list[str], task: str, rate: float, seed: int) -> bool:
    """Whether a finished report ran the quality.py flags `arguments` (each one given, the thread count included: it
    can change the last digits) at `rate` on `seed`."""
    given = vars(quality.build_parser().parse_args([*arguments, "--prefix", "check"]))
    ran = report.get("args", {})
    ignored = {"out_dir", "prefix", "log_every", "no_plots"}  # where the run wrote, and how often it printed
    every_row = ran.get("rows") is None or "diverged" in report  # not a run of some rows only
    return bool(report.get("finished") and every_row and ran.get(f"{task}_lr") == rate and ran.get("seeds") == [seed]
                and all(ran.get(k) == v for k, v in given.items() if k not in ignored and v not in (None, False)))  # fmt: skip


def run_paths(out_dir: str, task: str, rate: float, seed: int) -> list[str]:
    """The files a run of (task, rate, seed) may have written, in the order they were named."""
    base = os.path.join(out_dir, run_name(task, rate, seed))
    paths = [base + ".json"]
    index = 2
    while os.path.exists(f"{base}_run{index}.json"):
        paths.append(f"{base}_run{index}.json")
        index += 1
    return paths


def read_run(path: str, flag: str, fix: str) -> dict:
    """The report of one tuning run, or one line naming the file and what is wrong with it (`fix`: what to do)."""
    try:
        return quality.read_reports([path], flag)[0]
    except InputFileError as error:
        raise SystemExit(f"tuning.py: error: {error}; {fix}") from None


def finished_run(out_dir: str, arguments: list[str], task: str, rate: float, seed: int) -> dict | None:
    """The first finished run of these settings in `out_dir`, or None (a damaged file is refused in one line)."""
    for path in run_paths(out_dir, task, rate, seed):
        if os.path.exists(path):
            report = read_run(path, f"--task {task}", fix="move it away to run it again")
            if same_settings(report, arguments, task, rate, seed):
                return report
    return None


def chosen_run(out_dir: str, arguments: list[str], task: str, rate: float, seed: int) -> dict:
    """`finished_run` for --choose: a run that is missing, did not finish or ran other settings is refused in one line
    naming it, since a choice without it would not be the pass's."""
    again = f"run `experiments/tuning.py --task {task}` (again) to finish the pass"
    paths = [path for path in run_paths(out_dir, task, rate, seed) if os.path.exists(path)]
    if not paths:
        read_run(run_paths(out_dir, task, rate, seed)[0], "--choose", fix=again)  # says: no such file
    reports = [read_run(path, "--choose", fix=again) for path in paths]
    for report in reports:
        if same_settings(report, arguments, task, rate, seed):
            return report
    if not any(report.get("finished") for report in reports):
        raise SystemExit(f"tuning.py: error: --choose: {paths[-1]} is a run that did not finish; {again}")
    raise SystemExit(f"tuning.py: error: --choose: {paths[-1]} ran other settings than these flags (preset, data, "
                     f"threads); give --choose the flags of the pass, or {again}")  # fmt: skip


def task_has_runs(out_dir: str, task: str) -> bool:
    """Whether a tuning pass of `task` left any run in `out_dir` (then every run of it must be there)."""
    return any(name.startswith(f"{task}_lr") and name.endswith(".json") for name in os.listdir(out_dir))


def free_path(out_dir: str, task: str, rate: float, seed: int) -> str:
    """The first name of (task, rate, seed) that no file holds."""
    paths = run_paths(out_dir, task, rate, seed)
    return paths[0] if not os.path.exists(paths[0]) else paths[0][: -len(".json")] + f"_run{len(paths) + 1}.json"


def run_once(arguments: list[str], out_dir: str, task: str, rate: float, seed: int) -> dict:
    """The report of `quality.py <arguments>` at `rate` on `seed`: read from its JSON where a finished run of the same
    settings left one, else trained under the first free name (an existing file is never replaced).

    A row whose loss stops being finite ends quality.py's run; the run is then made again under the next free name
    without that row (the stopped run's file stays), and the finished report lists it under "diverged", so that at
    this rate the row counts as the worst of the grid."""
    report = finished_run(out_dir, arguments, task, rate, seed)
    if report is not None:
        print(f"{run_name(task, rate, seed)}: finished earlier, read from {out_dir}", flush=True)
        return report
    diverged: dict[str, str] = {}
    while True:
        path = free_path(out_dir, task, rate, seed)
        rows = ["--rows", *[r for r in all_rows(arguments) if r not in diverged]] if diverged else []
        try:
            report = quality.main([*arguments, f"--{task}-lr", repr(rate), "--seeds", str(seed), *rows,
                                   "--prefix", os.path.basename(path)[: -len(".json")]])  # fmt: skip
        except FloatingPointError as error:
            row = next((r for r in all_rows(arguments) if f" {r} seed {seed}:" in str(error)), None)
            if row is None or row in diverged:
                raise
            diverged[row] = str(error)
            print(f"{run_name(task, rate, seed)}: {row} diverged; again without it", flush=True)
            continue
        if diverged:
            report["diverged"] = diverged
            write_json(path, report)
        return report


def all_rows(arguments: list[str]) -> list[str]:
    """The names of the rows a quality.py run of `arguments` trains (built for seed 0, not trained)."""
    import torch

    args = quality.parse_args([*arguments, "--prefix", "rows"])
    maker = {"lm": quality.lm_task, "vit": quality.vit_task}[args.tasks[0]]
    return [row.name for row in maker(args, torch.device("cpu")).rows(0)]


def validation(report: dict, task: str) -> dict[str, float]:
    """{row: validation value} of a one-seed report; a row that diverged counts as the worst value there is."""
    worst = -math.inf if TASKS[task][3] else math.inf
    values = {row: records[0][TASKS[task][2]] for row, records in report["results"][task].items()}
    return {**values, **dict.fromkeys(report.get("diverged", {}), worst)}


def best(candidates: dict, task: str):
    """The key of the best validation value (lowest bits per byte, highest top-1)."""
    pick = max if TASKS[task][3] else min
    return pick(candidates, key=candidates.get)


def learning_rate_search(task: str, values_at: Callable[[float], dict]) -> dict[float, dict]:
    """{factor: {row: mean validation}} over the task's grid, grown past an edge while a method's best factor lies on
    it (at most `LR_EXTENSIONS` times per side). `values_at(factor)` trains or reads that factor's runs, every seed."""
    start = grid(task)
    search = {factor: values_at(factor) for factor in start}
    rows = list(search[start[0]])
    lowest, highest = start[0] / 2**LR_EXTENSIONS, start[-1] * 2**LR_EXTENSIONS
    while True:
        bests = {best({f: values[row] for f, values in search.items()}, task) for row in rows}
        low, high = min(search), max(search)
        beyond = [f for edge, f, limit in ((low, low / 2, lowest), (high, high * 2, highest))
                  if edge in bests and (f >= limit if f < edge else f <= limit)]  # fmt: skip
        if not beyond:
            return search
        for factor in beyond:
            search[factor] = values_at(factor)


def mean_over_seeds(reports: list[dict], task: str) -> dict[str, float]:
    per_row: dict[str, list[float]] = {}
    for report in reports:
        for row, value in validation(report, task).items():
            per_row.setdefault(row, []).append(value)
    return {row: statistics.fmean(values) for row, values in per_row.items()}


def tune(args, task: str) -> dict:
    base = common_arguments(args, task)

    def train(factor):
        rate = rate_of(args, task, factor)
        return mean_over_seeds([run_once(base, args.out_dir, task, rate, seed) for seed in args.seeds], task)

    return learning_rate_search(task, train)


def choose(args) -> dict:
    """chosen.json and tuning.md from the finished runs of every task tuned in `out_dir`: each row at the rate of its
    best mean validation over the seeds."""
    from experiments import report as built_report

    chosen, lines = {}, []
    for task, (_, damcha_row, _, _) in TASKS.items():
        base = common_arguments(args, task)

        def read(factor, task=task, base=base):
            rate = rate_of(args, task, factor)
            return mean_over_seeds([chosen_run(args.out_dir, base, task, rate, seed) for seed in args.seeds], task)

        if not task_has_runs(args.out_dir, task):  # this task was not tuned here: nothing to choose
            continue
        search = learning_rate_search(task, read)
        means = {
            row: {rate_of(args, task, f): values[row] for f, values in search.items()} for row in search[grid(task)[0]]
        }
        rates = {row: best(values, task) for row, values in means.items()}
        rates.update({"DAMCHA": rates[damcha_row]})  # quality.py's fallback for a DAMCHA row it is not given
        chosen[task] = {"lr": rates, "metric_hidden_size": preset(args)["metric_hidden_size"],
                        "metric_input_norm": "none", "metric_lr_multiplier": 1.0, "seeds": list(args.seeds),
                        "grid": sorted(rate_of(args, task, f) for f in search),
                        "mean_validation": {row: {f"{rate:g}": value if math.isfinite(value) else None
                                                  for rate, value in sorted(values.items())}
                                            for row, values in means.items()}}  # fmt: skip
        lines += [f"## {task}", "", built_report.tuning_table(os.path.abspath(args.out_dir), task), ""]
    if not chosen:
        raise SystemExit(
            f"--choose: no task has its runs on every seed of the grid in {args.out_dir}; run --task first"
        )
    write_json(os.path.join(args.out_dir, "chosen.json"), chosen)
    atomic_write(os.path.join(args.out_dir, "tuning.md"), "\n".join(lines))
    print("\n".join(lines) + "\n" + json.dumps({task: entry["lr"] for task, entry in chosen.items()}, indent=2))
    return chosen


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.task) == args.choose:
        parser.error("give either --task TASK (run its tuning pass) or --choose (read the runs)")
    if len(set(args.seeds)) < MINIMUM_SEEDS and not args.tiny:
        parser.error(f"--seeds: the same budget for every method is at least {MINIMUM_SEEDS} distinct seeds per rate, "
                     f"got {args.seeds}")  # fmt: skip
    os.makedirs(args.out_dir, exist_ok=True)
    if args.choose:
        return choose(args)
    return tune(args, args.task)


if __name__ == "__main__":
    main()
