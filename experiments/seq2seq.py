#!/usr/bin/env python
"""Sequence-to-sequence comparison: BART with MHA, DAMCHA and the baseline variants on the `train_bart.py` task.

    python experiments/seq2seq.py --out-dir runs/seq2seq --seeds 0 1 2            # train every row and seed
    python experiments/seq2seq.py --out-dir runs/seq2seq --seeds 0 --rows MHA     # one row
    python experiments/seq2seq.py --summarize runs/seq2seq --prefix seq2seq        # table + JSON of what is there

Each (row, seed) is one run of `recipes/train_bart.py` with the same settings, in `<out-dir>/<row>-s<seed>`: the same
seed gives every row the same tokenizer, the same training pairs in the same order and the same validation pairs;
rows differ in attention only (their starting weights are drawn from the same seed but not equal, since DAMCHA's and
DCMHA's extra modules take their draws in between). `--summarize` reads each run's `eval_results.json` and gives, per
row, the mean ± standard deviation over seeds of the validation loss (nats per target token), BLEU, chrF and ROUGE-L,
and the paired differences by seed (every row - MHA, every DAMCHA row - every baseline): mean ± standard error,
two-sided Student-t interval, seeds agreeing in sign, and the paired t-test's p-value adjusted by Holm's method for
the comparisons of its measure.
"""

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402  (standard library only)
from damcha_hf.modeling.variants import VARIANTS  # noqa: E402  (torch-free)
from damcha_hf.optional_packages import check_extras  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import (  # noqa: E402
    InputFileError,
    fmt_paired,
    format_table,
    multiple_comparisons,
    multiple_comparisons_sentence,
    paired_statistics,
    read_json_input,
    wrapped,
)

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "train_bart.py")
ROWS = {
    "MHA": ["--model-type", "bart"],
    "DAMCHA token": ["--metric-context", "token"],
    "DAMCHA query": ["--metric-context", "query"],
    # Every cross-head baseline of the registry, by its display name ("talking-heads", "DCMHA", "ColMHA", "MoA").
    **{
        variant.display_name.replace("_", "-"): ["--cross-head-variant", name]
        for name, variant in VARIANTS.items()
        if name not in ("damcha", "none")
    },
}
MEASURES = {"eval_loss": "loss (nats/token)", "eval_bleu": "BLEU", "eval_chrf": "chrF", "eval_rougeL": "ROUGE-L"}
DEFAULT_SETTINGS = ["--max-steps", "1000", "--batch-size", "32", "--d-model", "128", "--layers", "2", "--heads", "4",
                    "--ffn-dim", "512", "--max-eval-samples", "256", "--logging-steps", "100"]  # fmt: skip


def folder_name(row: str, seed: int) -> str:
    return f"{row.replace(' ', '_')}-s{seed}"


def train(args) -> None:
    for seed in args.seeds:
        for row in args.rows:
            folder = os.path.join(args.out_dir, folder_name(row, seed))
            if os.path.isfile(os.path.join(folder, "eval_results.json")):
                print(f"{row}, seed {seed}: done already ({folder})")
                continue
            command = [sys.executable, RECIPE, *DEFAULT_SETTINGS, *args.settings, *ROWS[row], "--seed", str(seed),
                       "--output-dir", folder, "--num-threads", str(args.threads)]  # fmt: skip
            print(f"{row}, seed {seed}: {' '.join(command[1:])}", flush=True)
            subprocess.run(command, check=True)


DAMCHA_ROWS = [row for row in ROWS if row.startswith("DAMCHA")]
BASELINE_ROWS = [row for row in ROWS if row != "MHA" and row not in DAMCHA_ROWS]


def comparison_pairs(rows: list[str]) -> list[tuple[str, str]]:
    """Every row against MHA, and every DAMCHA row against every baseline (DAMCHA - baseline)."""
    pairs = [(row, "MHA") for row in rows if row != "MHA"]
    return pairs + [(d, b) for d in DAMCHA_ROWS if d in rows for b in BASELINE_ROWS if b in rows]


def read_runs(folder: str) -> dict[str, dict[int, dict]]:
    """Each (row, seed) run's `eval_results.json` in FOLDER, by row and seed."""
    results: dict[str, dict[int, dict]] = {}
    if not os.path.isdir(folder):
        raise SystemExit(f"seq2seq.py: error: --summarize {folder}: no such folder; give the --out-dir of the runs")
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name, "eval_results.json")
        row_key, _, seed = name.rpartition("-s")
        row = row_key.replace("_", " ")
        if os.path.isfile(path) and row in ROWS and seed.isdigit():
            try:
                run = read_json_input(path, "--summarize", holds="the eval_results.json recipes/train_bart.py writes")
            except InputFileError as error:
                raise SystemExit(f"seq2seq.py: error: {error}; train that run again") from None
            results.setdefault(row, {})[int(seed)] = run
    return results


def summarize(folder: str, prefix: str) -> dict:
    results = read_runs(folder)
    if "MHA" not in results:
        raise SystemExit(f"--summarize {folder}: no MHA runs (folders MHA-s<seed>) to compare against")
    rows = [row for row in ROWS if row in results]
    summary = {"folder": folder, "rows": {}, "differences": {}, "multiple_comparisons": {}}
    table = []
    for row in rows:
        seeds = sorted(results[row])
        cells = [row, ",".join(map(str, seeds))]
        summary["rows"][row] = {}
        for key in MEASURES:
            values = [results[row][seed][key] for seed in seeds]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            summary["rows"][row][key] = {"per_seed": values, "mean": statistics.fmean(values), "std": spread}
            cells.append(f"{statistics.fmean(values):.3f} ± {spread:.3f}")
        table.append(cells)
    paired_seeds = {}
    for row, reference in comparison_pairs(rows):
        paired = paired_seeds[f"{row} − {reference}"] = sorted(set(results[row]) & set(results[reference]))
        summary["differences"][f"{row} − {reference}"] = {
            key: paired_statistics([results[row][s][key] - results[reference][s][key] for s in paired])
            for key in MEASURES
        }
    sentences = []
    for key, label in MEASURES.items():  # one family per measure: the comparisons of one column
        family = multiple_comparisons([by_key[key] for by_key in summary["differences"].values()])
        summary["multiple_comparisons"][key] = family
        sentences.append(f"{label}: {multiple_comparisons_sentence(family)}")
    differences = []
    for name, by_key in summary["differences"].items():
        cells = [name, ",".join(map(str, paired_seeds[name]))]
        for stats in by_key.values():
            holm = "" if stats.get("p_holm") is None else f" p_Holm {stats['p_holm']:.2f}"
            cells.append(fmt_paired(stats) + holm)
        differences.append(cells)
    print(format_table(["row", "seeds", *MEASURES.values()], table))
    print()
    print(format_table(["difference", "seeds", *MEASURES.values()], differences))
    print()
    print("\n".join(wrapped(sentence) for sentence in sentences))
    write_json(os.path.join(folder, f"{prefix}.json"), summary)
    return summary


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", help="one folder per (row, seed) run goes here")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per run")
    parser.add_argument("--summarize", metavar="FOLDER", help="summarize the runs in FOLDER instead of training")
    parser.add_argument("--prefix", default="seq2seq", help="name of the summary JSON")
    args, settings = parser.parse_known_args(argv)
    check_extras(parser, "experiments/seq2seq.py", "experiments", *(() if args.summarize else ("seq2seq",)))
    args.settings = settings  # any further flag goes to the recipe (e.g. --max-steps 2000)
    if args.summarize:
        summarize(args.summarize, args.prefix)
    elif args.out_dir:
        train(args)
    else:
        parser.error("give --out-dir to train, or --summarize FOLDER")


if __name__ == "__main__":
    main()
