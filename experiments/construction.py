"""Building and loading a DAMCHA GPT-2 against stock GPT-2, at GPT-2 small width, side by side.

- Construction time: `DamchaGPT2LMHeadModel(config)` and `GPT2LMHeadModel(config)`, alternated in one process over
  paired rounds; the ratio of each pair's times, its median and a bootstrap 95% interval over the pairs.
- Peak memory of construction: each model built alone in a fresh process (the process's peak resident set, minus
  its resident set just before building, with the libraries and the model code already imported), alternated the
  same way.
- `from_pretrained` time: the two models saved once (safetensors), then loaded alternately.

    python experiments/construction.py                # 10 rounds
    python experiments/construction.py --rounds 3     # a quick look
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

# The repository root, so that `experiments.common` imports when run as `python experiments/construction.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402  (standard library only)
from damcha_hf.optional_packages import check_extras  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import bootstrap_median_interval, interval_verdict  # noqa: E402

MEMORY_PROBE = """
import os, resource, sys, torch
import damcha_hf
from transformers import GPT2Config, GPT2LMHeadModel
torch.set_num_threads(1)
damcha_hf.DamchaGPT2LMHeadModel, damcha_hf.DamchaGPT2Config  # the model code imported before measuring
with open("/proc/self/statm") as statm:  # resident now, in kilobytes (ru_maxrss's unit on Linux)
    before = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
if sys.argv[1] == "damcha":
    model = damcha_hf.DamchaGPT2LMHeadModel(damcha_hf.DamchaGPT2Config())
else:
    model = GPT2LMHeadModel(GPT2Config())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rounds", type=int, default=10, help="paired rounds per measurement (default 10)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser


def paired_ratio(damcha: list[float], stock: list[float]) -> dict:
    """Median of the per-round ratios damcha/stock, a percentile bootstrap 95% interval of that median, and whether
    the interval excludes 1."""
    import statistics

    if 0 in stock:
        raise RuntimeError(f"a stock measurement came out as 0 ({stock}): no ratio can be taken; run again")
    ratios = [d / s for d, s in zip(damcha, stock)]
    interval = bootstrap_median_interval(ratios)
    return {"ratio": statistics.median(ratios), "interval": list(interval) if interval else None,
            "verdict": interval_verdict(interval, 1.0), "rounds": len(ratios)}  # fmt: skip


def alternate(rounds: int, measure_damcha, measure_stock) -> tuple[list[float], list[float]]:
    damcha, stock = [], []
    for round_index in range(rounds):
        # Alternate which goes first, so that a drift in the machine's speed falls on both alike.
        order = [(measure_damcha, damcha), (measure_stock, stock)]
        for measure, results in order if round_index % 2 == 0 else order[::-1]:
            results.append(measure())
    return damcha, stock


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_extras(parser, "experiments/construction.py", "experiments")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import damcha_hf

    torch.set_num_threads(args.threads)

    def timed(build):
        def measure():
            start = time.perf_counter()
            build()
            return time.perf_counter() - start

        return measure

    def build_damcha():
        return damcha_hf.DamchaGPT2LMHeadModel(damcha_hf.DamchaGPT2Config())

    def build_stock():
        return GPT2LMHeadModel(GPT2Config())

    def peak_memory(kind):
        def measure():
            output = subprocess.run([sys.executable, "-c", MEMORY_PROBE, kind], capture_output=True, text=True)
            if output.returncode != 0:
                raise RuntimeError(output.stderr)
            return float(output.stdout.strip().splitlines()[-1])  # kilobytes on Linux

        return measure

    figures = {"machine": f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}"}
    damcha, stock = alternate(args.rounds, timed(build_damcha), timed(build_stock))
    figures["construction_time"] = {**paired_ratio(damcha, stock), "damcha_s": min(damcha), "stock_s": min(stock)}
    damcha, stock = alternate(args.rounds, peak_memory("damcha"), peak_memory("stock"))
    figures["construction_peak_memory"] = {
        **paired_ratio(damcha, stock),
        "damcha_mb": min(damcha) / 1024,
        "stock_mb": min(stock) / 1024,
    }
    with tempfile.TemporaryDirectory() as folder:
        build_damcha().save_pretrained(f"{folder}/damcha")
        build_stock().save_pretrained(f"{folder}/stock")
        damcha, stock = alternate(
            args.rounds,
            timed(lambda: damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(f"{folder}/damcha")),
            timed(lambda: GPT2LMHeadModel.from_pretrained(f"{folder}/stock")),
        )
    figures["from_pretrained_time"] = {**paired_ratio(damcha, stock), "damcha_s": min(damcha), "stock_s": min(stock)}
    for name, figure in figures.items():
        if isinstance(figure, dict):
            interval = figure["interval"]
            shown = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
            print(f"{name}: DAMCHA / stock = {figure['ratio']:.3f}{shown} over {figure['rounds']} paired rounds: "
                  f"{figure['verdict']}")  # fmt: skip
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
