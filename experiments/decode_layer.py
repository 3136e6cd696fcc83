"""Where DAMCHA's batch-1 decoding time goes: one attention layer, one cached decoding step, on the CPU.

Times a stock `GPT2Attention`, DAMCHA's attention with `cross_head_variant="none"` (the same layer code without a
metric or mixing) and with `metric_context="token"`, and the `"token"` layer with its metric replaced by a stand-in
module whose generator is free (it returns a fixed `C`). The differences between the rows are the cost of each part
*inside* the layer, where the big `c_attn` GEMV has just streamed its weights through the cache; the last row times
the metric call alone, outside the layer. The rows take turns (rotating order, `--rounds` rounds of `--calls` calls each) and the
medians are reported, in microseconds per call. Run it on an idle machine: a busy one inflates the small operators'
latency most.

    python experiments/decode_layer.py                                  # GPT-2 small widths: 768 wide, 12 heads
    python experiments/decode_layer.py --width 384 --heads 6
"""

import argparse
import inspect
import statistics
import time
from collections.abc import Callable

from damcha_hf.argument_checks import ArgumentParser, positive_int  # standard library only


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--width", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    parser.add_argument("--metric-hidden-size", type=int, default=64, help="generator hidden size (default 64)")
    parser.add_argument("--cache-length", type=int, default=32, help="tokens already in the cache (default 32)")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    parser.add_argument("--calls", type=int, default=100, help="calls per row and round (default 100)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    return parser


def fixed_cross_head(metric, cross_head):
    """Stands in for `metric`: a copy of it (so the layer's call runs the same code) whose generator returns a `C`
    computed beforehand (for one token, broadcast to the input), at no cost."""
    import copy

    stub = copy.copy(metric)

    def forward(z, layer_idx=0, metric_mask="full"):
        return cross_head.expand(*z.shape[:-1], *cross_head.shape[-2:])

    stub.forward = forward
    return stub


def decoding_call(layer, prompt, token, metric=None, prefill_metric=None):
    """A function that runs one cached decoding step of `layer` on `token` after `prompt` and returns its output; the
    step's cache entry is dropped after it, so that every call decodes at the same position. `metric` (None: the layer
    takes no metric argument) is passed to the step, `prefill_metric` (default: `metric`) to the prompt's call."""
    import torch
    from transformers import GPT2Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cache = DynamicCache(config=GPT2Config(n_layer=1, n_embd=prompt.shape[-1]))
    cache_argument = "cache" if "cache" in inspect.signature(GPT2Attention.forward).parameters else "past_key_values"

    def metric_argument(value):
        return {} if value is None else {"cross_head_metric": value}

    with torch.no_grad():
        layer(prompt, **{cache_argument: cache}, **metric_argument(prefill_metric or metric))
    step_arguments = {cache_argument: cache, **metric_argument(metric)}

    def call():
        with torch.no_grad():
            output = layer(token, **step_arguments)[0]
        cache.layers[0].crop(-1)
        return output

    return call


def build_calls(width: int, heads: int, metric_hidden_size: int, cache_length: int) -> tuple[dict, Callable]:
    """The rows' decoding calls (all with the same weights, prompt and token) and a call of the metric alone."""
    import torch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    import damcha_hf
    from damcha_hf.modeling.metric import CrossHeadMetric
    from damcha_hf.modeling.modeling_damcha_gpt2 import DamchaGPT2Attention

    torch.manual_seed(0)
    settings = {"n_layer": 1, "n_embd": width, "n_head": heads, "attn_implementation": "sdpa"}
    stock = GPT2Attention(GPT2Config(**settings), layer_idx=0).eval()
    token_config = damcha_hf.DamchaGPT2Config(**settings, metric_hidden_size=metric_hidden_size)
    plain = DamchaGPT2Attention(damcha_hf.DamchaGPT2Config(**settings, cross_head_variant="none"), layer_idx=0)
    damcha = DamchaGPT2Attention(token_config, layer_idx=0)
    for layer in (plain, damcha):
        layer.load_state_dict(stock.state_dict(), strict=False)
        layer.eval()
    metric = CrossHeadMetric.from_config(token_config).eval()
    for parameter in metric.parameters():  # a trained generator: nonzero output layer
        torch.nn.init.normal_(parameter, std=0.2)
    prompt, token = torch.randn(1, cache_length, width), torch.randn(1, 1, width)
    with torch.no_grad():
        fixed = fixed_cross_head(metric, metric(token))
    calls = {
        "stock GPT2Attention": decoding_call(stock, prompt, token),
        'DAMCHA, cross_head_variant="none"': decoding_call(plain, prompt, token),
        'DAMCHA "token"': decoding_call(damcha, prompt, token, metric),
        '"token", metric stubbed': decoding_call(damcha, prompt, token, fixed, prefill_metric=metric),
    }

    def metric_alone():
        with torch.no_grad():
            return metric(token)

    return calls, metric_alone


def alternate(calls: dict, rounds: int, per_round: int) -> dict:
    names = list(calls)
    for call in calls.values():
        for _ in range(per_round):
            call()
    times = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(per_round):
                calls[name]()
            times[name].append((time.perf_counter() - start) / per_round * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    calls, metric_alone = build_calls(args.width, args.heads, args.metric_hidden_size, args.cache_length)
    medians = alternate(calls, args.rounds, args.calls)
    alone = alternate({"metric": metric_alone}, args.rounds, args.calls)["metric"]

    print(f"one attention layer, {args.width} wide, {args.heads} heads, batch 1, {args.cache_length} cached tokens, "
          f"{args.threads} thread(s); median microseconds per decoding call")  # fmt: skip
    reference = medians["stock GPT2Attention"]
    print("| row | µs | vs stock |\n|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.1f} | {value - reference:+.1f} |")
    print(f"| the metric call alone, outside the layer | {alone:.1f} | |")
    metric_cost = medians['DAMCHA "token"'] - medians['"token", metric stubbed']
    mixing_cost = medians['"token", metric stubbed'] - medians['DAMCHA, cross_head_variant="none"']
    print(
        f"\nthe metric inside the layer: {metric_cost:.1f} µs (alone: {alone:.1f} µs); the key mixing and the "
        f"code around it: {mixing_cost:.1f} µs"
    )
    return {**medians, "metric alone": alone}


if __name__ == "__main__":
    main()
