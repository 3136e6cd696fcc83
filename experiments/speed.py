"""Speed, memory and parameter cost of DAMCHA against vanilla transformers models, measured as ratios in one process.

For each shape (GPT-2 small, Llama at TinyLlama-1.1B widths with few layers, ViT-S/16) every row (MHA, a second MHA model as the
noise floor, each DAMCHA `metric_context`, the baseline variants when the configs offer `cross_head_variant`) is built
once; then the rows take turns: after warm-up, each round runs one training step (forward + backward + AdamW step)
of every row, in an order that rotates from round to round, so that a slow spell of a shared machine hits every row
alike. Ratios are *paired*: per round, a row's time over MHA's time in the same round, and the median over rounds.
Reported: step time and its ratio to MHA, training memory and its ratio (activation bytes also at other dropout
rates, `--memory-dropout`), greedy generation tokens/s with the KV cache and its ratio (GPT-2 only), the same with
the static cache and `torch.compile(fullgraph=True)` (`--parts ... compiled`), and the parameter overhead.

Verdicts: each ratio comes with a 95% percentile-bootstrap interval of its median over the paired rounds. The row
"MHA (repeat)" is a second, identical vanilla model timed in the same rounds: how far its interval reaches from 1 is
the noise floor of the run (load from other work, as on a shared machine). A ratio is called "resolved" only where
its interval lies beyond 1.0 (or `--target`) by more than that floor, on one side; an interval that excludes 1 by
less is "not resolved: within the MHA-vs-MHA noise floor ±x", otherwise "not resolved". Fewer than 6 rounds carry
no verdict at all: from n rounds even the min-max range covers a median with probability 1 - 2^(1-n) only (the 3
rounds of `--quick`: 75%), so those ratios are printed without one (`--repeats 6` or more for verdicts).
`--summarize FILE.json` prints the ratios, intervals and verdicts of an earlier run's JSON.

Memory:
  * CUDA: `torch.cuda.max_memory_allocated` over one training step, optimiser state already allocated (so it is the
    true peak of parameters + gradients + AdamW state + activations).
  * CPU (no per-run peak counter): the bytes of every tensor autograd saves for backward during the forward pass
    (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters excluded) = activation
    memory; "train memory" adds parameters, gradients and the two AdamW moments (4 x parameter bytes). This is
    the same quantity the CUDA peak measures, minus allocator slack and transient buffers.

Examples:
    python experiments/speed.py --quick
    python experiments/speed.py                       # GPT-2 small (12 x 768, 12 heads), seq 512 and 1024, batch 4
    python experiments/speed.py --layers 4 --batch 1 --seq 512 1024 --repeats 5 --json speed_cpu.json
    python experiments/speed.py --summarize speed_cpu.json --target 1.02   # the verdicts of a saved run, again
    python experiments/speed.py --parts generate compiled --models gpt2 --contexts token --no-variants   # decoding only
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

# The repository root, so that `experiments.common` imports when run as `python experiments/<script>.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402  (standard library only)
from damcha_hf.optional_packages import check_extras  # noqa: E402  (standard library only)
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402  (standard library only)
from experiments.common import (  # noqa: E402  (torch-free: --help stays fast)
    GPT2_CONTEXTS,
    LLAMA_CONTEXTS,
    VIT_CONTEXTS,
    InputFileError,
    Row,
    bootstrap_median_interval,
    count_parameters,
    floor_verdict,
    format_tables,
    gpt2_config_kwargs,
    gpt2_rows,
    llama_config_kwargs,
    llama_rows,
    median,
    noise_floor,
    read_json_input,
    rounds_for_interval,
    set_up_device,
    too_few_rounds_sentence,
    vit_config_kwargs,
    vit_rows,
    wrapped,
)

PARTS = ("train", "memory", "generate", "decode", "compiled")
# (ratio key, per-round times key): the step ratio is this row's time over MHA's, the others MHA's over this row's
# (tokens per second).
RATIOS = (("step_ratio", "step_s"), ("generate_ratio", "generate_s"), ("decode_ratio", "decode_s"),
          ("compiled_generate_ratio", "compiled_generate_s"))  # fmt: skip
# The second, identical vanilla model of every run: its ratios to MHA are the timing noise of the same rounds.
NOISE_FLOOR_ROW = "MHA (repeat)"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="small preset: GPT-2 and ViT (add Llama with --models gpt2 llama vit), 2 layers, seq 256, batch 1, "
        "3 repeats, no talking-heads/DCMHA rows (add them with --variants)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="smallest preset, for the tests (seconds)")
    parser.add_argument("--layers", type=int, help="GPT-2 and ViT layers (default 12)")
    parser.add_argument("--width", type=int, help="GPT-2 width (default 768)")
    parser.add_argument("--heads", type=int, help="GPT-2 heads (default 12)")
    parser.add_argument("--vit-width", type=int, help="ViT width (default 384, ViT-S)")
    parser.add_argument("--vit-heads", type=int, help="ViT heads (default 6, ViT-S)")
    parser.add_argument("--image-size", type=int, help="ViT image size (default 224, patch 16)")
    parser.add_argument("--seq", type=int, nargs="+", help="GPT-2 sequence lengths (default 512 1024)")
    parser.add_argument("--batch", type=int, help="training batch (default 4)")
    parser.add_argument("--vit-batch", type=int, help="ViT training batch (default: --batch)")
    parser.add_argument("--repeats", type=int, help="timed repeats per row (median reported; default 7)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up steps per row (default 2)")
    parser.add_argument("--gen-repeats", type=int, help="timed generation rounds (default: --repeats)")
    parser.add_argument(
        "--decode-rounds", type=int, default=200,
        help="rounds of the 'decode' part: one cached decoding step per row per round (default 200)",
    )  # fmt: skip
    parser.add_argument("--gen-prompt", type=int, help="generation prompt length (default 64)")
    parser.add_argument("--gen-tokens", type=int, help="greedy new tokens per generation (default 128)")
    parser.add_argument("--gen-batch", type=int, default=1, help="generation batch (default 1)")
    parser.add_argument("--vocab", type=int, help="GPT-2 vocabulary (default 50257)")
    parser.add_argument("--metric-hidden-size", type=int, default=64)
    parser.add_argument(
        "--models", nargs="+", choices=["gpt2", "llama", "vit"],
        help="default: gpt2 llama vit (--quick: gpt2 vit; the Llama rows at TinyLlama widths would take more than "
        "half of its time)",
    )  # fmt: skip
    parser.add_argument(
        "--llama-layers", type=int,
        help="Llama layers at TinyLlama-1.1B widths (2048 wide, 32 query / 4 key-value heads, MLP 5632, vocabulary "
        "32000; default 2: the full 22 layers is a GPU shape)",
    )  # fmt: skip
    parser.add_argument("--no-variants", action="store_true", help="skip the cross_head_variant baseline rows")
    parser.add_argument(
        "--variants", action="store_true",
        help="with --quick: also the talking-heads and DCMHA rows (they dominate its time and memory)",
    )  # fmt: skip
    parser.add_argument("--scores-form", action="store_true",
                        help="add a 'DAMCHA scores <context>' row per context: metric_form='scores' (eager attention)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="profile one training step per row (torch.profiler)")
    parser.add_argument(
        "--parts", nargs="+", default=["train", "memory", "generate"], choices=PARTS,
        help="what to measure (default: train memory generate); 'decode' = single cached greedy decoding steps at "
        "the prompt length, many short alternating rounds (resolves small differences on a noisy machine); "
        "'compiled' = static-cache generation under torch.compile(fullgraph=True), DAMCHA and MHA both compiled "
        "(minutes of compile time per row on a CPU)",
    )  # fmt: skip
    parser.add_argument("--contexts", nargs="+", help="DAMCHA metric_context rows (default: all the model accepts)")
    parser.add_argument(
        "--memory-dropout", type=float, nargs="+", default=[0.0, 0.1],
        help="dropout rates at which activation bytes are also counted (default 0 and 0.1, GPT2Config's default)",
    )  # fmt: skip
    parser.add_argument(
        "--target", type=float, default=1.0,
        help="the ratio each interval is judged against (default 1.0: does the row differ from MHA at all)",
    )  # fmt: skip
    parser.add_argument("--summarize", metavar="JSON", help="print the ratios and verdicts of an earlier run's JSON")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--threads", type=positive_int, default=2,
        help="torch CPU threads (default 2; on a machine shared with other jobs, 1 thread gives steadier timings)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_extras(parser, "experiments/speed.py", "experiments")  # the intervals: before minutes of timing

    preset = {"layers": 12, "width": 768, "heads": 12, "vit_width": 384, "vit_heads": 6, "image_size": 224, "seq": [512, 1024],
                  "batch": 4, "repeats": 7, "warmup": 2, "gen_prompt": 64, "gen_tokens": 128, "vocab": 50257}  # fmt: skip
    llama_preset = {"llama_layers": 2}
    if args.models is None:
        args.models = ["gpt2", "vit"] if args.quick else ["gpt2", "llama", "vit"]
    if args.quick:
        llama_preset = {"llama_layers": 1}
        # The talking-heads and DCMHA rows (n x n score mixing) would take most of a --quick run's time and memory.
        args.no_variants = args.no_variants or not args.variants
        preset.update(layers=2, seq=[256], batch=1, repeats=3, warmup=1, gen_prompt=16, gen_tokens=16)
    if args.tiny:
        llama_preset = {"llama_layers": 1, "llama_width": 64, "llama_heads": 8, "llama_kv_heads": 2,
                        "llama_intermediate": 128, "llama_vocab": 512}  # fmt: skip
        preset.update(layers=1, width=64, heads=4, vit_width=64, vit_heads=4, image_size=32, seq=[32], batch=1,
                      repeats=2, warmup=1, gen_prompt=4, gen_tokens=4, vocab=512)  # fmt: skip
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.llama_layers = args.llama_layers or llama_preset["llama_layers"]
    args.llama_shape = {
        key.removeprefix("llama_"): value for key, value in llama_preset.items() if key != "llama_layers"
    }
    if args.vit_batch is None:
        args.vit_batch = args.batch
    if args.gen_repeats is None:
        args.gen_repeats = args.repeats
    for name in (
        "layers",
        "width",
        "heads",
        "batch",
        "repeats",
        "gen_repeats",
        "gen_tokens",
        "gen_prompt",
        "image_size",
        "vocab",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if {"decode", "compiled"} & set(args.parts) and not {"gpt2", "llama"} & set(args.models):
        parser.error("--parts decode/compiled measure generation, which needs --models gpt2 or llama")
    if args.llama_layers <= 0:
        parser.error(f"--llama-layers must be positive, got {args.llama_layers}")
    if args.width % args.heads or args.vit_width % args.vit_heads:
        parser.error("--heads must divide --width and --vit-heads must divide --vit-width")
    return args


class Clock:
    """Wall-clock on CPU; CUDA events on GPU (the step is queued, so host timing would measure nothing).

    `cuda` is the `torch.cuda` namespace (the default); the tests pass a stand-in with the same four calls, so that the
    GPU path runs (and is checked) on a CPU-only machine.
    """

    def __init__(self, device, cuda=None):
        import torch

        self.on_gpu = device.type == "cuda"
        self.cuda = cuda or torch.cuda

    def time(self, function) -> float:
        if self.on_gpu:
            start, end = self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True)
            self.cuda.synchronize()
            start.record()
            function()
            end.record()
            self.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0
        start = time.perf_counter()
        function()
        return time.perf_counter() - start


def training_step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def saved_activation_bytes(model, batch) -> int:
    """Bytes autograd saves for backward in one forward pass: each storage once, parameters (and their views) excluded."""
    import torch

    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameter_storages and pointer not in saved:
            saved[pointer] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def training_memory(model, optimizer, batch, device, cuda=None) -> tuple[float, float]:
    """(train memory bytes, activation bytes); see the module docstring for the method per device.

    `cuda` as in `Clock`: the tests run the GPU branch on a CPU with a stand-in.
    """
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        if cuda is None:
            import torch

            cuda = torch.cuda
        optimizer.zero_grad(set_to_none=True)
        cuda.synchronize()
        cuda.reset_peak_memory_stats(device)
        baseline = cuda.memory_allocated(device)
        training_step(model, optimizer, batch)
        cuda.synchronize()
        peak = cuda.max_memory_allocated(device)
        return float(peak), float(peak - baseline)
    activations = saved_activation_bytes(model, batch)
    return float(4 * parameter_bytes + activations), float(activations)


def lm_batch(batch, seq, vocab, device, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def image_batch(batch, image_size, labels, device, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    return {"pixel_values": pixels, "labels": torch.randint(0, labels, (batch,), generator=generator).to(device)}


def alternate(functions, repeats: int, clock) -> list[list[float]]:
    """`times[row][round]`: each round times every function once, in an order that rotates from round to round."""
    times = [[] for _ in functions]
    for repeat in range(repeats):
        order = list(range(len(functions)))
        order = order[repeat % len(order) :] + order[: repeat % len(order)]
        for index in order:
            times[index].append(clock.time(functions[index]))
    return times


def with_noise_floor(rows: list) -> list:
    """The rows with a second, independently built MHA model after the first: two identical models whose paired
    ratio shows the timing noise of this machine."""
    return [rows[0], Row(NOISE_FLOOR_ROW, rows[0].build, "mha"), *rows[1:]]


def decoding_step(model, prompt):
    """A function that runs one greedy decoding step on a KV cache holding `prompt`, then drops that step's entry from
    the cache again, so that every call decodes at the same position: the unit of cached generation, short enough
    to alternate between rows hundreds of times."""
    import inspect

    import torch

    with torch.no_grad():
        output = model(input_ids=prompt, use_cache=True)
    cache = output.past_key_values
    token = output.logits[:, -1:].argmax(-1)
    # The cache argument is `cache` from transformers 5.24 on (`past_key_values` warns there), `past_key_values` before.
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step():
        with torch.no_grad():
            logits = model(input_ids=token, **{cache_argument: cache}, use_cache=True).logits
        for layer in cache.layers:
            layer.crop(-1)
        return logits

    return step


def compile_config(device):
    """Static-cache decoding compiled with `fullgraph=True`; CUDA graphs on a GPU, plain inductor on a CPU."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told otherwise
    return config


def measure(rows, batch, args, device, generation_prompt=None, memory_batch_builder=None) -> list[dict]:
    """Build every row, then alternate: warm-up, timed training steps, memory, and generation (if a prompt).

    `memory_batch_builder(dropout)` returns `(rows, batch)` built at another dropout rate, for `--memory-dropout`.
    """
    import torch

    clock = Clock(device)
    models, optimizers = [], []
    for row in rows:
        model = row.build().to(device)
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-4))
    results = [{"row": row.name, "kind": row.kind, "parameters": count_parameters(m)} for row, m in zip(rows, models)]
    print(wrapped(f"  built {', '.join(row.name for row in rows)}"), flush=True)

    if "train" in args.parts:
        for _ in range(args.warmup):
            for model, optimizer in zip(models, optimizers):
                training_step(model, optimizer, batch)
        steps = [functools.partial(training_step, m, o, batch) for m, o in zip(models, optimizers)]
        for result, times in zip(results, alternate(steps, args.repeats, clock)):
            result["step_s"] = times
        print("  timed training steps done", flush=True)

    if "memory" in args.parts:
        for result, model, optimizer in zip(results, models, optimizers):
            result["train_memory_bytes"], result["activation_bytes"] = training_memory(model, optimizer, batch, device)
        for dropout in args.memory_dropout:
            if dropout == 0.0 or memory_batch_builder is None:
                continue
            dropout_rows, dropout_batch = memory_batch_builder(dropout)
            for result, row in zip(results, dropout_rows):
                model = row.build().to(device)
                memory = training_memory(model, torch.optim.AdamW(model.parameters()), dropout_batch, device)
                result[f"activation_bytes_dropout_{dropout:g}"] = memory[1]
                del model
        print("  memory counted", flush=True)

    generating = generation_prompt is not None and ({"generate", "decode", "compiled"} & set(args.parts))
    if generating:
        for model in models:
            model.eval()
            model.generation_config.eos_token_id = None  # never stop early: every row generates the same count
            model.generation_config.pad_token_id = 0

        def generate(model, **options):
            with torch.no_grad():
                model.generate(
                    generation_prompt, max_new_tokens=args.gen_tokens, min_new_tokens=args.gen_tokens,
                    do_sample=False, use_cache=True, **options,
                )  # fmt: skip

        new_tokens = generation_prompt.shape[0] * args.gen_tokens
        if "generate" in args.parts:
            calls = [functools.partial(generate, model) for model in models]
            for call in calls:
                call()  # warm-up
            for result, times in zip(results, alternate(calls, args.gen_repeats, clock)):
                result["generate_s"] = times
                result["generate_tokens_per_s"] = new_tokens / median(times)
        if "decode" in args.parts:
            steps = [decoding_step(model, generation_prompt) for model in models]
            for step in steps:
                step()  # warm-up
            for result, times in zip(results, alternate(steps, args.decode_rounds, clock)):
                result["decode_s"] = times
                result["decode_tokens_per_s"] = generation_prompt.shape[0] / median(times)
        if "compiled" in args.parts:
            # "query" (no static-cache form) and the eager-only score-mixing variants are not compiled; every other
            # row is, MHA included, so that the ratio compares compiled with compiled.
            compiled = [
                index for index, row in enumerate(rows)
                if row.name != "DAMCHA query" and "eager" not in row.name
            ]  # fmt: skip
            calls = [
                functools.partial(generate, models[i], cache_implementation="static", compile_config=compile_config(device))
                for i in compiled
            ]  # fmt: skip
            for index, call in zip(compiled, calls):
                started = time.perf_counter()
                call()  # compiles
                results[index]["compile_s"] = time.perf_counter() - started
                print(f"  compiled {rows[index].name} in {results[index]['compile_s']:.0f} s", flush=True)
            for index, times in zip(compiled, alternate(calls, args.gen_repeats, clock)):
                results[index]["compiled_generate_s"] = times
                results[index]["compiled_generate_tokens_per_s"] = new_tokens / median(times)

    summarise(results, args.target)

    if args.profile:
        for model, optimizer, result in zip(models, optimizers, results):
            model.train()
            result["profile"] = profile_step(model, optimizer, batch, device)
        for row, result in zip(rows[1:], results[1:]):
            result["profile_vs_mha"] = profile_difference(row.name, result["profile"], results[0]["profile"])
            print("\n" + result["profile_vs_mha"], flush=True)
        if generating:
            for model, result in zip(models, results):
                model.eval()
                result["generate_profile"] = profile_call(functools.partial(generate, model), device)
            for row, result in zip(rows[1:], results[1:]):
                result["generate_profile_vs_mha"] = profile_difference(
                    f"{row.name} (generation)", result["generate_profile"], results[0]["generate_profile"]
                )
                print("\n" + result["generate_profile_vs_mha"], flush=True)
    return results


def round_ratios(ratio: str, times: list[float], reference: list[float]) -> list[float]:
    """Per round, this row's time over MHA's (the step ratio) or MHA's over this row's (tokens/s ratios)."""
    pairs = zip(times, reference) if ratio == "step_ratio" else zip(reference, times)
    return [numerator / denominator for numerator, denominator in pairs]


# The verdict of a ratio whose rounds are too few for a 95% interval (`rounds_for_interval`): its median and range are
# printed, judged by nothing.
NO_VERDICT = "no verdict"


def summarise(results: list[dict], target: float = 1.0) -> None:
    """Ratios to the first row (MHA): per timing, the paired median with its bootstrap interval over the rounds and
    the verdict against `target`, and the ratio of the fastest rounds; memory and parameter ratios.

    The verdicts are judged against the noise floor of the same rounds: the row "MHA (repeat)", a second identical
    MHA model, gives per timing how far from 1 the ratio of two identical models reaches (`noise_floor`); a row's
    ratio is "resolved" only where its interval lies beyond `target` by more than that (`floor_verdict`). Below
    `rounds_for_interval()` rounds no interval of a median reaches 95% coverage: such a ratio gets no verdict."""
    reference = results[0]
    for result in results:
        if "step_s" in result:
            result["step_median_s"] = median(result["step_s"])
            result["step_spread"] = [min(result["step_s"]), max(result["step_s"])]
            # On a shared machine interference only ever adds time, so the ratio of the fastest runs is also robust.
            result["step_min_ratio"] = min(result["step_s"]) / min(reference["step_s"])
        if "train_memory_bytes" in result:
            result["memory_ratio"] = result["train_memory_bytes"] / reference["train_memory_bytes"]
            result["activation_ratio"] = result["activation_bytes"] / reference["activation_bytes"]
            for key in [k for k in result if k.startswith("activation_bytes_dropout_")]:
                suffix = key.removeprefix("activation_bytes")
                result[f"activation_ratio{suffix}"] = result[key] / reference[key]
        result["parameter_overhead"] = result["parameters"] / reference["parameters"] - 1
        for ratio, key in RATIOS:
            if key in result and key in reference:
                per_round = round_ratios(ratio, result[key], reference[key])
                result[ratio] = median(per_round)
                if ratio != "step_ratio":
                    result[ratio.replace("_ratio", "_min_ratio")] = min(reference[key]) / min(result[key])
                if result is not reference:
                    result[f"{ratio}_interval"] = bootstrap_median_interval(per_round)
    floor_row = next((r for r in results[1:] if r["row"] == NOISE_FLOOR_ROW), None)
    for ratio, key in RATIOS:
        floor = noise_floor(floor_row.get(f"{ratio}_interval")) if floor_row else None
        for result in results[1:]:
            if f"{ratio}_interval" not in result:
                continue
            rounds = result[f"{ratio}_rounds"] = min(len(result[key]), len(reference[key]))
            if 2 <= rounds < rounds_for_interval():
                result[f"{ratio}_verdict"] = f"{NO_VERDICT} ({rounds} rounds)"
                continue
            if result is floor_row:
                result[f"{ratio}_noise_floor"] = floor
                result[f"{ratio}_verdict"] = (
                    "not resolved (fewer than 2 rounds)"
                    if floor is None
                    else f"the MHA-vs-MHA noise floor: ±{floor:.3f}"
                )
            else:
                result[f"{ratio}_verdict"] = floor_verdict(result[f"{ratio}_interval"], target, floor)


def verdict_lines(results: list[dict]) -> list[str]:
    """One line per row and timing ratio: the median, its 95% bootstrap interval and the verdict."""
    lines = []
    for result in results[1:]:
        for ratio, _ in RATIOS:
            if f"{ratio}_verdict" in result:
                interval = result[f"{ratio}_interval"]
                shown = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
                lines.append(f"{result['row']}: {ratio} {result[ratio]:.3f}{shown}: {result[f'{ratio}_verdict']}")
    return lines


def summarize_file(path: str, target: float) -> dict:
    """The ratios, intervals and verdicts of an earlier run's JSON, recomputed from its per-round times."""
    try:
        report = read_json_input(path, "--summarize", holds="the JSON a speed.py run wrote (--json)", keys=("shapes",))
    except InputFileError as error:
        raise SystemExit(f"speed.py: error: {error}") from None
    for shape in report["shapes"]:
        summarise(shape["results"], target)
        shape["table"] = print_table(shape["title"], shape["results"])
    return report


def profile_step(model, optimizer, batch, device) -> dict[str, dict]:
    """Self time (ms) and call count per operator over one training step (after one unprofiled step)."""
    return profile_call(lambda: training_step(model, optimizer, batch), device)


def profile_call(function, device) -> dict[str, dict]:
    """Self time (ms) and call count per operator over one call of `function` (after one unprofiled call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    function()
    with profile(activities=activities) as profiler:
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ops = {}
    for event in profiler.key_averages():
        self_us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        ops[event.key] = {"self_ms": self_us / 1000.0, "calls": event.count}
    return ops


def profile_difference(row: str, ops: dict, reference: dict, top: int = 12) -> str:
    """The operators whose self time grew most against MHA: where the extra time of a row goes."""
    keys = set(ops) | set(reference)
    delta = {k: ops.get(k, {}).get("self_ms", 0.0) - reference.get(k, {}).get("self_ms", 0.0) for k in keys}
    total = sum(v["self_ms"] for v in ops.values())
    reference_total = sum(v["self_ms"] for v in reference.values())
    lines = [
        (
            f"{row}: profiled step {total:.0f} ms vs MHA {reference_total:.0f} ms ({total - reference_total:+.0f} ms); "
            "largest increases by operator:"
        ),
        f"  {'operator':40s} {'self ms':>9s} {'MHA ms':>9s} {'delta':>9s} {'calls':>7s} {'MHA calls':>9s}",
    ]
    for key in sorted(keys, key=lambda k: -delta[k])[:top]:
        mine, theirs = ops.get(key, {}), reference.get(key, {})
        lines.append(
            f"  {key[:40]:40s} {mine.get('self_ms', 0):9.1f} {theirs.get('self_ms', 0):9.1f} {delta[key]:+9.1f} "
            f"{mine.get('calls', 0):7d} {theirs.get('calls', 0):9d}"
        )
    return "\n".join(lines)


def print_table(title: str, results: list[dict]) -> str:
    columns = [  # (header, format of one result or None when the column is absent)
        ("row", lambda r: r["row"]),
        ("params", lambda r: f"{r['parameters'] / 1e6:.2f}M"),
        ("param overhead", lambda r: f"{100 * r['parameter_overhead']:+.2f}%"),
        ("step ms (median)", lambda r: f"{1000 * r['step_median_s']:.1f}"),
        ("step ratio (paired)", lambda r: f"{r['step_ratio']:.3f}"),
        ("step ratio (min)", lambda r: f"{r['step_min_ratio']:.3f}"),
        ("train mem MB", lambda r: f"{r['train_memory_bytes'] / 2**20:.0f}"),
        ("mem ratio", lambda r: f"{r['memory_ratio']:.3f}"),
        ("activation ratio", lambda r: f"{r['activation_ratio']:.3f}"),
    ]
    for key in sorted({k for r in results for k in r if k.startswith("activation_ratio_dropout_")}):
        columns.append((f"activation ratio (dropout {key.rsplit('_', 1)[1]})", lambda r, key=key: f"{r[key]:.3f}"))
    columns += [
        ("gen tok/s", lambda r: f"{r['generate_tokens_per_s']:.1f}"),
        ("gen ratio (paired)", lambda r: f"{r['generate_ratio']:.3f}"),
        ("gen ratio (min)", lambda r: f"{r['generate_min_ratio']:.3f}"),
        ("decode step ms (median)", lambda r: f"{1000 * median(r['decode_s']):.2f}"),
        ("decode ratio (paired)", lambda r: f"{r['decode_ratio']:.3f}"),
        ("compiled gen tok/s", lambda r: f"{r['compiled_generate_tokens_per_s']:.1f}"),
        ("compiled gen ratio (paired)", lambda r: f"{r['compiled_generate_ratio']:.3f}"),
    ]

    def cell(format_result, result):
        try:
            return format_result(result)
        except KeyError:
            return "-"

    columns = [(h, f) for h, f in columns if any(cell(f, r) != "-" for r in results)]
    table_rows = [[cell(f, r) for _, f in columns] for r in results]
    text = "\n" + wrapped(f"### {title}") + "\n\n" + format_tables([h for h, _ in columns], table_rows)
    rounds = sorted({r[f"{ratio}_rounds"] for r in results for ratio, _ in RATIOS
                     if r.get(f"{ratio}_verdict", "").startswith(NO_VERDICT)})  # fmt: skip
    if verdict_lines(results):
        text += "\n\n" + wrapped(
            f"95% bootstrap intervals over the paired rounds; a ratio is resolved only where its interval lies beyond "
            f"--target (1 by default) by more than the noise floor of the same rounds ({NOISE_FLOOR_ROW}, a second identical MHA model):\n"
            + "".join(too_few_rounds_sentence(n) + "\n" for n in rounds)
            + "\n".join(verdict_lines(results))
        )
    print(text, flush=True)
    return text


def gpt2_dropout(dropout: float) -> dict:
    return {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}


def measure_decoder(args, device, seq: int, vocab: int, build_rows, title: str) -> dict:
    """One causal-LM shape: training steps on `seq` tokens and generation from a prompt, for the rows of
    `build_rows(dropout)`; the shape's title, table and per-row results."""
    batch = lm_batch(args.batch, seq, vocab, device, seed=seq)
    prompt = lm_batch(args.gen_batch, args.gen_prompt, vocab, device, seed=1)["input_ids"]
    results = measure(build_rows(), batch, args, device, generation_prompt=prompt,
                      memory_batch_builder=lambda dropout: (build_rows(dropout), batch))  # fmt: skip
    if {"train", "memory"} & set(args.parts):
        title += f", batch {args.batch} x seq {seq}"
    if {"generate", "decode", "compiled"} & set(args.parts):
        title += f"; generation: batch {args.gen_batch}, prompt {args.gen_prompt}, {args.gen_tokens} new tokens"
    return {"title": title, "table": print_table(title, results), "results": results}


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        return summarize_file(args.summarize, args.target)
    import torch

    device, machine = set_up_device(args.device, args.threads)
    print(wrapped(f"speed.py on {machine}; torch {torch.__version__}; args: {vars(args)}"), flush=True)
    report = {"machine": machine, "torch": torch.__version__, "args": dict(vars(args)), "shapes": []}
    variants = not args.no_variants

    if "gpt2" in args.models:
        for seq in args.seq:
            kwargs = gpt2_config_kwargs(
                args.layers, args.width, args.heads, max(seq, args.gen_prompt + args.gen_tokens), args.vocab
            )
            contexts = [c for c in (args.contexts or GPT2_CONTEXTS) if c in GPT2_CONTEXTS]

            def build_rows(dropout=0.0, kwargs=kwargs, contexts=contexts):
                rows = gpt2_rows(
                    {**kwargs, **gpt2_dropout(dropout)}, contexts=contexts, metric_hidden_size=args.metric_hidden_size,
                    variants=variants, scores_form=args.scores_form,
                )  # fmt: skip
                return with_noise_floor(rows)

            title = f"GPT-2 {args.layers} layers x {args.width}, {args.heads} heads"
            report["shapes"].append(measure_decoder(args, device, seq, args.vocab, build_rows, title))

    if "llama" in args.models:
        shape = {"width": 2048, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocab": 32000, **args.llama_shape}
        for seq in args.seq:
            kwargs = llama_config_kwargs(args.llama_layers, max(seq, args.gen_prompt + args.gen_tokens), **shape)
            contexts = [c for c in (args.contexts or LLAMA_CONTEXTS) if c in LLAMA_CONTEXTS]

            def build_llama_rows(dropout=0.0, kwargs=kwargs, contexts=contexts):
                rows = llama_rows({**kwargs, "attention_dropout": dropout}, contexts=contexts,
                                  metric_hidden_size=args.metric_hidden_size)  # fmt: skip
                return with_noise_floor(rows)

            title = (f"Llama (TinyLlama widths) {args.llama_layers} layers x {shape['width']}, {shape['heads']} query / "
                     f"{shape['kv_heads']} key-value heads")  # fmt: skip
            report["shapes"].append(measure_decoder(args, device, seq, shape["vocab"], build_llama_rows, title))

    if "vit" in args.models:
        kwargs = vit_config_kwargs(args.image_size, 16, 3, args.layers, args.vit_width, args.vit_heads, 1000)
        contexts = [c for c in (args.contexts or VIT_CONTEXTS) if c in VIT_CONTEXTS]

        def build_vit_rows(dropout=0.0):
            rows = vit_rows(
                {**kwargs, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout},
                contexts=contexts, metric_hidden_size=args.metric_hidden_size, variants=variants,
                scores_form=args.scores_form,
            )  # fmt: skip
            return with_noise_floor(rows)

        batch = image_batch(args.vit_batch, args.image_size, 1000, device, seed=0)
        parts = args.parts
        args.parts = [p for p in parts if p not in ("generate", "decode", "compiled")]
        try:
            results = measure(
                build_vit_rows(), batch, args, device, memory_batch_builder=lambda p: (build_vit_rows(p), batch)
            )
        finally:
            args.parts = parts
        title = (f"ViT {args.layers} layers x {args.vit_width}, {args.vit_heads} heads, patch 16, "
                 f"image {args.image_size}, batch {args.vit_batch}")  # fmt: skip
        report["shapes"].append({"title": title, "table": print_table(title, results), "results": results})

    if args.json:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
