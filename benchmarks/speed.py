"""Speed, memory and parameter cost of DAMCHA against vanilla transformers models, measured as ratios in one process.

For each shape (GPT-2 small and, once `damcha_hf` has ViT, ViT-S/16) every row (MHA, each DAMCHA `metric_context`,
the baseline variants when the configs offer `cross_head_variant`) is built once; then the rows take turns:
after warm-up, each repeat runs one training step (forward + backward + AdamW step) of every row, in an order that
rotates from repeat to repeat, so that a slow spell of a shared machine hits every row alike. Reported: the median
step time and its ratio to MHA, the training memory and its ratio, greedy generation tokens/s with the KV cache and
its ratio (GPT-2 only), and the parameter overhead.

Memory:
  * CUDA: `torch.cuda.max_memory_allocated` over one training step, optimiser state already allocated (so it is the
    true peak of parameters + gradients + AdamW state + activations).
  * CPU (no per-run peak counter): the bytes of every tensor autograd saves for backward during the forward pass
    (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters excluded) = activation
    memory; "train memory" adds parameters, gradients and the two AdamW moments (4 x parameter bytes). This is
    the same quantity the CUDA peak measures, minus allocator slack and transient buffers.

Examples:
    python benchmarks/speed.py --quick
    python benchmarks/speed.py                       # GPT-2 small (12 x 768, 12 heads), seq 512 and 1024, batch 4
    python benchmarks/speed.py --layers 4 --batch 1 --seq 512 1024 --repeats 5 --json docs/speed_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (
    GPT2_CONTEXTS,
    VIT_CONTEXTS,
    count_parameters,
    format_table,
    gpt2_config_kwargs,
    gpt2_rows,
    has_vit,
    median,
    set_up_device,
    vit_config_kwargs,
    vit_rows,
    write_json_atomic,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small preset (2 layers, seq 256, batch 1): a few minutes")
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
    parser.add_argument("--gen-prompt", type=int, help="generation prompt length (default 64)")
    parser.add_argument("--gen-tokens", type=int, help="greedy new tokens per generation (default 128)")
    parser.add_argument("--gen-batch", type=int, default=1, help="generation batch (default 1)")
    parser.add_argument("--vocab", type=int, help="GPT-2 vocabulary (default 50257)")
    parser.add_argument("--metric-hidden-size", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["gpt2", "vit"], choices=["gpt2", "vit"])
    parser.add_argument("--no-variants", action="store_true", help="skip the cross_head_variant baseline rows")
    parser.add_argument("--profile", action="store_true", help="profile one training step per row (torch.profiler)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, default=2,
        help="torch CPU threads (default 2; on a machine shared with other jobs, 1 thread gives steadier timings)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    preset = {"layers": 12, "width": 768, "heads": 12, "vit_width": 384, "vit_heads": 6, "image_size": 224, "seq": [512, 1024],
                  "batch": 4, "repeats": 7, "warmup": 2, "gen_prompt": 64, "gen_tokens": 128, "vocab": 50257}  # fmt: skip
    if args.quick:
        preset.update(layers=2, seq=[256], batch=1, repeats=3, warmup=1, gen_prompt=16, gen_tokens=16)
    if args.tiny:
        preset.update(layers=1, width=64, heads=4, vit_width=64, vit_heads=4, image_size=32, seq=[32], batch=1,
                      repeats=2, warmup=1, gen_prompt=4, gen_tokens=4, vocab=512)  # fmt: skip
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.vit_batch is None:
        args.vit_batch = args.batch
    for name in ("layers", "width", "heads", "batch", "repeats", "gen_tokens", "gen_prompt", "image_size", "vocab"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.width % args.heads or args.vit_width % args.vit_heads:
        parser.error("--heads must divide --width and --vit-heads must divide --vit-width")
    return args


class Clock:
    """Wall-clock on CPU; CUDA events on GPU (the step is queued, so host timing would measure nothing)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, function) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
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


def training_memory(model, optimizer, batch, device) -> tuple[float, float]:
    """(train memory bytes, activation bytes); see the module docstring for the method per device."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        training_step(model, optimizer, batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
        return float(peak), float(peak - baseline)
    activations = saved_activation_bytes(model, batch)
    return float(4 * parameter_bytes + activations), float(activations)


def lm_batch(batch, seq, vocab, device, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def image_batch(batch, image_size, labels, device, seed):
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    return {"pixel_values": pixels, "labels": torch.randint(0, labels, (batch,), generator=generator).to(device)}


def measure(rows, batch, args, device, generation_prompt=None) -> list[dict]:
    """Build every row, then alternate: warm-up, timed training steps, memory, and generation (if a prompt)."""
    clock = Clock(device)
    models, optimizers = [], []
    for row in rows:
        model = row.build().to(device)
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-4))
    results = [
        {"row": row.name, "kind": row.kind, "parameters": count_parameters(m), "step_s": []}
        for row, m in zip(rows, models)
    ]

    print(f"  built {', '.join(row.name for row in rows)}; warming up", flush=True)
    for _ in range(args.warmup):
        for model, optimizer in zip(models, optimizers):
            training_step(model, optimizer, batch)
    for repeat in range(args.repeats):
        order = list(range(len(rows)))
        order = order[repeat % len(order) :] + order[: repeat % len(order)]  # rotate who goes first
        for index in order:
            seconds = clock.time(functools.partial(training_step, models[index], optimizers[index], batch))
            results[index]["step_s"].append(seconds)
    print("  timed training steps done; measuring memory", flush=True)
    for result, model, optimizer in zip(results, models, optimizers):
        result["train_memory_bytes"], result["activation_bytes"] = training_memory(model, optimizer, batch, device)

    if generation_prompt is not None:
        for model in models:
            model.eval()
            model.generation_config.eos_token_id = None  # never stop early: every row generates the same count
            model.generation_config.pad_token_id = 0
        for result in results:
            result["generate_s"] = []

        def generate(model):
            with torch.no_grad():
                model.generate(
                    generation_prompt, max_new_tokens=args.gen_tokens, min_new_tokens=args.gen_tokens,
                    do_sample=False, use_cache=True,
                )  # fmt: skip

        for model in models:
            generate(model)  # warm-up
        for repeat in range(args.repeats):
            order = list(range(len(rows)))
            order = order[repeat % len(order) :] + order[: repeat % len(order)]
            for index in order:
                results[index]["generate_s"].append(clock.time(functools.partial(generate, models[index])))
        new_tokens = generation_prompt.shape[0] * args.gen_tokens
        for result in results:
            result["generate_tokens_per_s"] = new_tokens / median(result["generate_s"])

    reference = results[0]
    for result in results:
        result["step_median_s"] = median(result["step_s"])
        result["step_ratio"] = result["step_median_s"] / reference["step_median_s"]
        result["step_spread"] = [min(result["step_s"]), max(result["step_s"])]
        # On a shared machine interference only ever adds time, so the ratio of the fastest runs is the more robust.
        result["step_min_ratio"] = min(result["step_s"]) / min(reference["step_s"])
        result["memory_ratio"] = result["train_memory_bytes"] / reference["train_memory_bytes"]
        result["activation_ratio"] = result["activation_bytes"] / reference["activation_bytes"]
        result["parameter_overhead"] = result["parameters"] / reference["parameters"] - 1
        if "generate_tokens_per_s" in result:
            result["generate_ratio"] = result["generate_tokens_per_s"] / reference["generate_tokens_per_s"]
            result["generate_min_ratio"] = min(reference["generate_s"]) / min(result["generate_s"])

    if args.profile:
        for model, optimizer, result in zip(models, optimizers, results):
            model.train()
            result["profile"] = profile_step(model, optimizer, batch, device)
        for row, result in zip(rows[1:], results[1:]):
            result["profile_vs_mha"] = profile_difference(row.name, result["profile"], results[0]["profile"])
            print("\n" + result["profile_vs_mha"], flush=True)
        if generation_prompt is not None:
            for model, result in zip(models, results):
                model.eval()
                result["generate_profile"] = profile_call(functools.partial(generate, model), device)
            for row, result in zip(rows[1:], results[1:]):
                result["generate_profile_vs_mha"] = profile_difference(
                    f"{row.name} (generation)", result["generate_profile"], results[0]["generate_profile"]
                )
                print("\n" + result["generate_profile_vs_mha"], flush=True)
    return results


def profile_step(model, optimizer, batch, device) -> dict[str, dict]:
    """Self time (ms) and call count per operator over one training step (after one unprofiled step)."""
    return profile_call(lambda: training_step(model, optimizer, batch), device)


def profile_call(function, device) -> dict[str, dict]:
    """Self time (ms) and call count per operator over one call of `function` (after one unprofiled call)."""
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
    headers = ["row", "params", "param overhead", "step ms (median)", "step ratio", "step ratio (min)", "train mem MB",
               "mem ratio", "activation ratio", "gen tok/s", "gen ratio", "gen ratio (min)"]  # fmt: skip
    table_rows = []
    for r in results:
        table_rows.append([
            r["row"], f"{r['parameters'] / 1e6:.2f}M", f"{100 * r['parameter_overhead']:+.2f}%",
            f"{1000 * r['step_median_s']:.1f}", f"{r['step_ratio']:.3f}", f"{r['step_min_ratio']:.3f}",
            f"{r['train_memory_bytes'] / 2**20:.0f}",
            f"{r['memory_ratio']:.3f}", f"{r['activation_ratio']:.3f}",
            f"{r['generate_tokens_per_s']:.1f}" if "generate_tokens_per_s" in r else "-",
            f"{r['generate_ratio']:.3f}" if "generate_ratio" in r else "-",
            f"{r['generate_min_ratio']:.3f}" if "generate_min_ratio" in r else "-",
        ])  # fmt: skip
    text = f"\n### {title}\n\n" + format_table(headers, table_rows)
    print(text, flush=True)
    return text


def main(argv=None):
    args = parse_args(argv)
    device, machine = set_up_device(args.device, args.threads)
    print(f"speed.py on {machine}; torch {torch.__version__}; args: {vars(args)}", flush=True)
    report = {"machine": machine, "torch": torch.__version__, "args": vars(args), "shapes": []}
    variants = not args.no_variants

    if "gpt2" in args.models:
        vocab = args.vocab
        for seq in args.seq:
            kwargs = gpt2_config_kwargs(
                args.layers, args.width, args.heads, max(seq, args.gen_prompt + args.gen_tokens), vocab
            )
            rows = gpt2_rows(
                kwargs, contexts=GPT2_CONTEXTS, metric_hidden_size=args.metric_hidden_size, variants=variants
            )
            batch = lm_batch(args.batch, seq, vocab, device, seed=seq)
            prompt = lm_batch(args.gen_batch, args.gen_prompt, vocab, device, seed=1)["input_ids"]
            results = measure(rows, batch, args, device, generation_prompt=prompt)
            title = (f"GPT-2 {args.layers} layers x {args.width}, {args.heads} heads, batch {args.batch} x seq {seq}; "
                     f"generation: batch {args.gen_batch}, prompt {args.gen_prompt}, {args.gen_tokens} new tokens")  # fmt: skip
            report["shapes"].append({"title": title, "table": print_table(title, results), "results": results})

    if "vit" in args.models:
        if not has_vit():
            print("\n(ViT rows skipped: damcha_hf has no DamchaViTConfig yet)", flush=True)
        else:
            kwargs = vit_config_kwargs(args.image_size, 16, 3, args.layers, args.vit_width, args.vit_heads, 1000)
            rows = vit_rows(
                kwargs, contexts=VIT_CONTEXTS, metric_hidden_size=args.metric_hidden_size, variants=variants
            )
            batch = image_batch(args.vit_batch, args.image_size, 1000, device, seed=0)
            results = measure(rows, batch, args, device)
            title = (f"ViT {args.layers} layers x {args.vit_width}, {args.vit_heads} heads, patch 16, "
                     f"image {args.image_size}, batch {args.vit_batch}")  # fmt: skip
            report["shapes"].append({"title": title, "table": print_table(title, results), "results": results})

    if args.json:
        write_json_atomic(args.json, report)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
