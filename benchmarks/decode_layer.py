"""Where DAMCHA's batch-1 decoding time goes: one attention layer, one cached decoding step, on the CPU.

Times a stock `GPT2Attention`, DAMCHA's attention with `cross_head_variant="none"` (the same layer code without a
metric) and with `metric_context="token"`, then the `"token"` layer with parts of DAMCHA replaced by stand-ins of no
cost: the metric by a module that returns a fixed `C`, and also the key mixing by the identity. The differences
between the rows are the cost of each part *inside* the layer, where the big `c_attn` GEMV has just streamed its
weights through the cache; the last column times the metric call alone, outside the layer. Every row takes turns
(rotating order, `--rounds` rounds of `--calls` calls) and medians are reported, in microseconds per call.

    python benchmarks/decode_layer.py                                  # GPT-2 small widths: 768 wide, 12 heads
    python benchmarks/decode_layer.py --width 384 --heads 6
"""

import argparse
import inspect
import statistics
import time

import torch
from transformers import GPT2Config
from transformers.cache_utils import DynamicCache
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

import damcha_hf
from damcha_hf.modeling import damcha_attention
from damcha_hf.modeling.damcha_attention import CrossHeadMetric
from damcha_hf.modeling.modeling_damcha_gpt2 import DamchaGPT2Attention


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    parser.add_argument("--metric-hidden-size", type=int, default=64, help="generator hidden size (default 64)")
    parser.add_argument("--cache-length", type=int, default=32, help="tokens already in the cache (default 32)")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    parser.add_argument("--calls", type=int, default=100, help="calls per row and round (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser.parse_args(argv)


class FixedCrossHead(torch.nn.Module):
    """Stands in for the metric: returns a `C` computed beforehand, at no cost."""

    def __init__(self, cross_head: torch.Tensor):
        super().__init__()
        self.cross_head = cross_head

    def forward(self, z, layer_idx=0, metric_mask="full"):
        return self.cross_head


def decoding_call(layer, cache_length: int, width: int, metric):
    """One cached decoding step of `layer` at position `cache_length`; the step's cache entry is dropped after it."""
    config = GPT2Config(n_layer=1, n_embd=width)
    cache = DynamicCache(config=config)
    cache_argument = "cache" if "cache" in inspect.signature(GPT2Attention.forward).parameters else "past_key_values"
    extra = {} if metric is False else {"cross_head_metric": metric}
    with torch.no_grad():
        layer(torch.randn(1, cache_length, width), **{cache_argument: cache}, **extra)
    token = torch.randn(1, 1, width)

    def call():
        with torch.no_grad():
            layer(token, **{cache_argument: cache}, **extra)
        cache.layers[0].crop(-1)

    return call


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
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    settings = {"n_layer": 1, "n_embd": args.width, "n_head": args.heads, "attn_implementation": "sdpa"}
    stock = GPT2Attention(GPT2Config(**settings), layer_idx=0).eval()
    token_config = damcha_hf.DamchaGPT2Config(**settings, metric_hidden_size=args.metric_hidden_size)
    layers = {
        "stock GPT2Attention": stock,
        'DAMCHA, cross_head_variant="none"': DamchaGPT2Attention(
            damcha_hf.DamchaGPT2Config(**settings, cross_head_variant="none"), layer_idx=0
        ),
        'DAMCHA "token"': DamchaGPT2Attention(token_config, layer_idx=0),
    }
    for layer in layers.values():
        layer.load_state_dict(stock.state_dict(), strict=False)
        layer.eval()
    metric = CrossHeadMetric.from_config(token_config).eval()
    for parameter in metric.parameters():  # a trained generator: nonzero output layer
        torch.nn.init.normal_(parameter, std=0.02)
    probe = torch.randn(1, 1, args.width)
    with torch.no_grad():
        fixed = FixedCrossHead(metric(probe))
    token_layer = layers['DAMCHA "token"']
    calls = {
        "stock GPT2Attention": decoding_call(stock, args.cache_length, args.width, False),
        'DAMCHA, cross_head_variant="none"': decoding_call(
            layers['DAMCHA, cross_head_variant="none"'], args.cache_length, args.width, None
        ),
        'DAMCHA "token"': decoding_call(token_layer, args.cache_length, args.width, metric),
        '"token", metric stubbed': decoding_call(token_layer, args.cache_length, args.width, fixed),
    }
    medians = alternate(calls, args.rounds, args.calls)
    original_mixing = damcha_attention.mix_keys_per_token
    damcha_attention.mix_keys_per_token = lambda cross_head, key, compact_saved_key=False: key
    try:
        stubbed = alternate(
            {
                "stock GPT2Attention": calls["stock GPT2Attention"],
                '"token", metric and mixing stubbed': calls['"token", metric stubbed'],
            },
            args.rounds,
            args.calls,
        )
    finally:
        damcha_attention.mix_keys_per_token = original_mixing
    with torch.no_grad():
        alone = alternate({"metric": lambda: metric(probe)}, args.rounds, args.calls)["metric"]

    print(f"one attention layer, {args.width} wide, {args.heads} heads, batch 1, {args.cache_length} cached tokens, "
          f"{args.threads} thread(s); median microseconds per decoding call")  # fmt: skip
    reference = medians["stock GPT2Attention"]
    print("| row | µs | vs stock |\n|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.1f} | {value - reference:+.1f} |")
    both = stubbed['"token", metric and mixing stubbed'] - stubbed["stock GPT2Attention"]
    print(f'| "token", metric and mixing stubbed | {reference + both:.1f} | {both:+.1f} |')
    print(f"| the metric call alone, outside the layer | {alone:.1f} | |")
    metric_cost = medians['DAMCHA "token"'] - medians['"token", metric stubbed']
    rest_cost = medians['"token", metric stubbed'] - reference - both
    print(
        f"\nthe metric inside the layer: {metric_cost:.1f} µs (alone: {alone:.1f} µs); the mixing: {rest_cost:.1f} µs"
    )


if __name__ == "__main__":
    main()
