"""Serving speed in vLLM: a DAMCHA decoder against the same stock model, paired rounds in one run.

Question: what does serving a DAMCHA checkpoint through vLLM's Transformers backend cost against the stock model it
was converted from, in generated tokens per second and CPU-seconds per token, and does the Transformers backend
itself cost enough against vLLM's own model implementation to make a native registration of the DAMCHA models pay?

Three rows (two for GPT-2, see `rows_for`), one vLLM engine each, all alive in one process (`experiments/vllm_serving_worker.py`, run in the
interpreter that has vLLM): the stock model in vLLM's own implementation (`model_impl="vllm"`), the stock model in the
Transformers backend, and the DAMCHA model (the stock weights plus a random non-zero metric generator, so it computes
what a trained one does) in the Transformers backend. Each round generates the same batch of prompts on every row
(greedy, a fixed number of new tokens, no early stop) in a rotating order. Ratios are per round, against the stock
model in the Transformers backend; each gets the median and a 95% percentile-bootstrap interval over the rounds
(`experiments/common.py`). The checkpoints are built here, with the plugin.

    python experiments/vllm_serving.py --vllm-python /path/to/venv-vllm/bin/python --shape cpu-small \\
        --rounds 10 --out experiments/vllm-serving/cpu_small.json
    # a lent GPU (vLLM's CUDA build installed there): GPT-2 small and Qwen2-0.5B, batch 64, 1,024 new tokens
    python experiments/vllm_serving.py --vllm-python python --shape gpt2-small --batch 64 --prompt-tokens 128 \\
        --new-tokens 1024 --rounds 5 --dtype bfloat16 --compiled --out experiments/vllm-serving/gpu_gpt2_small.json
    python experiments/vllm_serving.py --vllm-python python --shape qwen2-0.5b --batch 64 --prompt-tokens 128 \\
        --new-tokens 1024 --rounds 5 --dtype bfloat16 --compiled --out experiments/vllm-serving/gpu_qwen2_0_5b.json
    python experiments/vllm_serving.py --summarize experiments/vllm-serving/cpu_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# The repository root, so that `experiments.common` imports when run as `python experiments/<script>.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import bootstrap_median_interval, format_table, interval_verdict, median  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_serving_worker.py")
GOAL = 0.95  # DAMCHA's tokens per second, as a share of the stock model's in the same backend
# name: (family, stock config fields). Random weights: speed does not depend on training.
SHAPES = {
    # A Llama of 6 layers of width 384 (6 query heads of 64 sharing 2 key/value heads): small enough for 2 CPU cores,
    # large enough that the model, not the engine's bookkeeping, takes most of a step.
    "cpu-small": (
        "llama",
        {
            "num_hidden_layers": 6,
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "vocab_size": 32000,
        },
    ),
    "gpt2-small": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 2048, "vocab_size": 50257}),
    # Qwen2-0.5B's widths: 24 layers of 896, 14 query heads sharing 2 key/value heads of 64, tied embeddings.
    "qwen2-0.5b": (
        "qwen2",
        {
            "num_hidden_layers": 24,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
        },
    ),
}
ROWS = (
    ("stock, vLLM's implementation", "stock", "vllm"),
    ("stock, Transformers backend", "stock", "transformers"),
    ("DAMCHA, Transformers backend", "damcha", "transformers"),
)
NATIVE, STOCK, DAMCHA = (name for name, _, _ in ROWS)


def rows_for(shape: str) -> tuple:
    """The rows a shape can run. vLLM 0.32's Transformers backend cannot load a stock GPT-2 checkpoint (it drops every
    `c_attn.bias`, which GPT-2's ignored-key pattern "attn.bias" finds; the DAMCHA GPT-2 anchors it): for GPT-2 the
    DAMCHA model is compared with the stock model in vLLM's own implementation."""
    return tuple(row for row in ROWS if not (SHAPES[shape][0] == "gpt2" and row[0] == STOCK))


def reference_of(names) -> str:
    return STOCK if STOCK in names else NATIVE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--vllm-python", help="the python of the environment that has vLLM (docs/serving.md)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu-small", help="the model shape (default: %(default)s)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="paired rounds after one warm-up (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled forward (default: eager)")
    parser.add_argument("--work-dir", help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", help="the results JSON")
    parser.add_argument("--summarize", metavar="FILE", help="print the table of a results JSON again, and stop")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse a run that could not finish, before building anything."""
    if args.summarize:
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required: the python of the environment that has vLLM (docs/serving.md)")
    for name in ("batch", "prompt_tokens", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.out and os.path.exists(args.out):
        parser.error(f"--out {args.out} exists; name a new file (results are never overwritten)")


def build_checkpoints(shape: str, work_dir: str, prompts: int, prompt_tokens: int) -> tuple[dict, list[list[int]]]:
    """The stock checkpoint and the DAMCHA one converted from it (a random non-zero generator), with a byte-level
    tokenizer; and the prompts (random token ids, the same for every row)."""
    import torch
    import transformers

    import damcha_hf
    from damcha_hf.data import byte_level_tokenizer
    from damcha_hf.families import family_for_model_type

    model_type, fields = SHAPES[shape]
    family = family_for_model_type(model_type)
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    torch.manual_seed(0)
    stock = family.task_head.stock_class(config_class(**fields)).eval()
    damcha = damcha_hf.convert_to_damcha(stock).eval()
    with torch.no_grad():  # off the generator's zero start: the mixing runs with the values a trained model has
        generator = torch.Generator().manual_seed(0)
        for name, parameter in damcha.named_parameters():
            if "cross_head_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    paths = {}
    for name, model in (("stock", stock), ("damcha", damcha)):
        paths[name] = os.path.join(work_dir, name)
        model.save_pretrained(paths[name])
        byte_level_tokenizer(1_000_000).save_pretrained(paths[name])
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 256, (prompts, prompt_tokens), generator=generator).tolist()
    return paths, prompt_ids


def summarize(result: dict) -> dict:
    """Per row: the medians of tokens per second and CPU-seconds per token; per round, each row's ratio to the
    reference row (tokens per second, and CPU-seconds per token), with the median's interval."""
    rounds = result["rounds"]
    names = [name for name, _, _ in ROWS if name in rounds[0]]
    reference = reference_of(names)
    summary = {"reference": reference}
    for name in names:
        speed = [r[name]["tokens"] / r[name]["wall_seconds"] for r in rounds]
        cpu = [r[name]["cpu_seconds"] / r[name]["tokens"] for r in rounds]
        ratios = [
            (r[name]["tokens"] / r[name]["wall_seconds"]) / (r[reference]["tokens"] / r[reference]["wall_seconds"])
            for r in rounds
        ]
        cpu_ratios = [
            (r[name]["cpu_seconds"] / r[name]["tokens"]) / (r[reference]["cpu_seconds"] / r[reference]["tokens"])
            for r in rounds
        ]
        summary[name] = {
            "tokens_per_second": median(speed),
            "cpu_seconds_per_token": median(cpu),
            "speed_ratio": median(ratios),
            "speed_ratio_interval": bootstrap_median_interval(ratios),
            "cpu_ratio": median(cpu_ratios),
            "cpu_ratio_interval": bootstrap_median_interval(cpu_ratios),
        }
    damcha = summary[DAMCHA]
    summary["verdicts"] = {
        f"DAMCHA against {reference}, goal {GOAL}": interval_verdict(damcha["speed_ratio_interval"], GOAL),
        f"DAMCHA against {reference}": interval_verdict(damcha["speed_ratio_interval"], 1.0),
    }
    if reference == STOCK:
        # The stock model's greedy tokens in vLLM's implementation and in the Transformers backend (the warm-up).
        summary["stock_tokens_equal_across_implementations"] = result["tokens"][NATIVE] == result["tokens"][STOCK]
        # vLLM's own implementation against the Transformers backend, stock model: a ratio above 1 is what a native
        # registration could gain.
        summary["verdicts"][f"{NATIVE} against {STOCK}"] = interval_verdict(
            summary[NATIVE]["speed_ratio_interval"], 1.0
        )
    return summary


def table(result: dict) -> str:
    summary = result["summary"]

    def interval(values) -> str:
        return f"[{values[0]:.3f}, {values[1]:.3f}]" if values else "-"

    rows = [
        [
            name,
            f"{summary[name]['tokens_per_second']:.1f}",
            f"{1000 * summary[name]['cpu_seconds_per_token']:.2f}",
            f"{summary[name]['speed_ratio']:.3f} {interval(summary[name]['speed_ratio_interval'])}",
            f"{summary[name]['cpu_ratio']:.3f} {interval(summary[name]['cpu_ratio_interval'])}",
        ]
        for name, _, _ in ROWS
        if name in summary
    ]
    headers = ["row", "tokens/s", "CPU ms/token", "tokens/s ratio [95%]", "CPU/token ratio [95%]"]
    verdicts = "\n".join(f"{key}: {value}" for key, value in summary["verdicts"].items())
    return f"{format_table(headers, rows)}\n{verdicts}"


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.summarize:
        with open(args.summarize) as file:
            print(table(json.load(file)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.work_dir or scratch
        paths, prompts = build_checkpoints(args.shape, work_dir, args.batch, args.prompt_tokens)
        request = {
            "rows": [
                {"name": name, "path": paths[model], "model_impl": impl} for name, model, impl in rows_for(args.shape)
            ],
            "prompts": prompts,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "dtype": args.dtype,
            "enforce_eager": not args.compiled,
            "max_model_len": args.prompt_tokens + args.new_tokens,
        }
        request_path, result_path = os.path.join(scratch, "request.json"), os.path.join(scratch, "result.json")
        with open(request_path, "w") as file:
            json.dump(request, file)
        # vLLM's CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB): 1 holds these batches many times over,
        # for each of the three engines (a GPU build ignores it).
        environment = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
        subprocess.run([args.vllm_python, WORKER, request_path, result_path], check=True, env=environment)
        with open(result_path) as file:
            result = json.load(file)
    result["settings"] = {key: value for key, value in vars(args).items() if key not in ("summarize",)}
    result["settings"]["model"] = SHAPES[args.shape]
    result["summary"] = summarize(result)
    print(table(result))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
