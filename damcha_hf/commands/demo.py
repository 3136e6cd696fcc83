"""`damcha-hf demo`: train a small DAMCHA GPT-2 and an identically trained multi-head-attention GPT-2 side by side.

Both models start from the same weights (the DAMCHA model is `convert_to_damcha` of the MHA one, so its metric
generator starts at zero and it computes exactly MHA at step 0), see the same batches in the same order with the same
optimiser, and are evaluated on the same validation blocks. The default corpus is the Python standard library's own
sources (every machine has them), byte-level, so the loss in bits per token is bits per byte. The DAMCHA model is
saved as a Hub-ready checkpoint (model card, loss curve, metric heatmap: `damcha_hf.hub`).
"""

import argparse
import math
import os
import time

RESULTS_FILE = "demo_results.json"
DEFAULT_MAX_STEPS = 1000
DEFAULT_TIME_BUDGET_MINUTES = 6.0
CALIBRATION_STEPS = 16
WARMUP_TIMING_STEPS = 4


def _light(name: str):
    """A standard-library-only module of damcha_hf, without importing torch (see `damcha_hf_cli.light_import`)."""
    from damcha_hf_cli import light_import

    return light_import(name)


def output_folder(text: str) -> str:
    """`--output-dir`: a new or empty folder, or an earlier demo checkpoint (replaced); checked before training."""
    try:
        _light("damcha_hf.safe_files").check_checkpoint_folder(text, argument="")
    except OSError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    checks = _light("damcha_hf.argument_checks")
    parser = subparsers.add_parser(
        "demo",
        help="train a small DAMCHA GPT-2 and an identical MHA GPT-2 on local text; compare, save, sample",
        description=__doc__,
        formatter_class=checks.HelpFormatter,
    )
    parser.add_argument("--data", default="stdlib", type=checks.text_data_source,
                        help="text to train on: 'stdlib' (default: Python's standard library sources), 'gcide', a "
                        "text file, a folder of .txt files or a glob")  # fmt: skip
    parser.add_argument("--output-dir", default="./damcha-demo", type=output_folder,
                        help="where the DAMCHA checkpoint goes: a new or empty folder, or an earlier demo's output "
                        "(replaced); a folder holding other files is refused")  # fmt: skip
    parser.add_argument("--max-steps", type=checks.positive_int, default=DEFAULT_MAX_STEPS,
                        help=f"at most this many optimizer steps per model (default: {DEFAULT_MAX_STEPS})")  # fmt: skip
    parser.add_argument("--time-budget", type=checks.non_negative_float, default=DEFAULT_TIME_BUDGET_MINUTES,
                        help="minutes of training for both models together (default: "
                        f"{DEFAULT_TIME_BUDGET_MINUTES:g}): the step count is fixed after {CALIBRATION_STEPS} timed "
                        "steps so the schedule still anneals; 0 = no limit, train --max-steps")  # fmt: skip
    parser.add_argument("--batch-size", type=checks.positive_int, default=16)
    parser.add_argument("--block-size", type=checks.positive_int, default=128,
                        help="context length in bytes (default: 128)")  # fmt: skip
    parser.add_argument("--n-layer", type=checks.positive_int, default=4)
    parser.add_argument("--n-embd", type=checks.positive_int, default=128)
    parser.add_argument("--n-head", type=checks.positive_int, default=8, help="must divide --n-embd (default: 8)")
    parser.add_argument("--metric-context", choices=("token", "query"), default="token")
    parser.add_argument("--metric-hidden-size", type=checks.positive_int, default=64)
    parser.add_argument("--learning-rate", type=checks.positive_float, default=3e-3)
    parser.add_argument("--max-data-bytes", type=checks.positive_int, default=3_000_000,
                        help="read about this many bytes of text (default: 3 MB)")  # fmt: skip
    parser.add_argument("--eval-blocks", type=checks.positive_int, default=96, help="validation blocks (default: 96)")
    parser.add_argument("--eval-every", type=checks.positive_int, default=None,
                        help="evaluate every N steps (default: 5 times)")  # fmt: skip
    parser.add_argument("--sample-tokens", type=checks.positive_int, default=120,
                        help="bytes to generate for the sample (at most the context length)")  # fmt: skip
    parser.add_argument("--prompt", default="def ", help="prompt of the generated sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-threads", type=checks.positive_int, default=None, help="torch CPU threads (default: all cores)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _fastest_thread_count(model, batch) -> int:
    """1 thread or one per core, whichever runs a training step faster here and now.

    Small matrices gain little from a second thread, and on a machine whose cores are busy with other work, torch's
    threads wait on each other: 2 threads measured 5x slower than 1 on a loaded 2-core machine. Gradients are cleared
    afterwards, and no optimizer step is taken, so training is unaffected.
    """
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates = sorted({1, max(1, min(cores, torch.get_num_threads()))})
    if len(candidates) == 1:
        return candidates[0]
    timings = {}
    for threads in candidates + candidates:  # twice each: the first call also pays one-off costs
        torch.set_num_threads(threads)
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        timings[threads] = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return min(timings, key=timings.get)


def _evaluate(model, blocks, batch_size):
    """(mean NLL in nats per predicted byte, bits per byte) over `blocks` (a LongTensor of token blocks)."""
    import torch

    from damcha_hf.metrics import causal_lm_token_nll

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start : start + batch_size]
            nll = causal_lm_token_nll(model(input_ids=batch).logits, batch)
            total, count = total + nll.double().sum().item(), count + nll.numel()
    model.train()
    return total / count, total / count / math.log(2)


def check_arguments(args: argparse.Namespace) -> None:
    """What depends on several arguments, checked before anything is imported or loaded."""
    checks = _light("damcha_hf.argument_checks")
    message = checks.heads_divide_width_error(args.n_embd, args.n_head, width_flag="--n-embd", heads_flag="--n-head")
    if message:
        raise ValueError(message)
    if len(args.prompt.encode("utf-8")) >= args.block_size:
        raise ValueError(f"--prompt must be shorter than --block-size ({args.block_size} bytes).")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    # One demo per output folder: the lock file sits beside the folder, which the save replaces as a whole.
    output = os.path.abspath(args.output_dir)
    lock_file = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.lock")
    lock = _light("damcha_hf.safe_files").hold_lock(lock_file, what=f"--output-dir {args.output_dir}")
    try:
        return _train_compare_and_save(args)
    finally:
        lock.release()


def _train_compare_and_save(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    import torch
    from tqdm.auto import tqdm
    from transformers import GPT2Config, GPT2LMHeadModel

    from damcha_hf import convert_to_damcha
    from damcha_hf.data import byte_level_tokenizer, group_into_blocks, load_text_corpus
    from damcha_hf.metrics import load_metric

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)

    tokenizer = byte_level_tokenizer()
    corpus = load_text_corpus(args.data, seed=args.seed, max_bytes=args.max_data_bytes)
    separate_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    blocks = group_into_blocks(corpus, tokenizer, args.block_size, separate_documents=separate_documents)
    train_blocks = torch.tensor(blocks["train"]["input_ids"])
    eval_blocks = torch.tensor(blocks["validation"]["input_ids"][: args.eval_blocks])
    print(f"[{time.perf_counter() - started:.0f} s] data: {args.data}: {len(train_blocks)} training and {len(eval_blocks)} validation blocks of "
          f"{args.block_size} bytes")  # fmt: skip

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    mha = GPT2LMHeadModel(config)
    # The same starting weights for both: the converted model's generator is zero, so it starts as exactly MHA.
    damcha = convert_to_damcha(mha, metric_context=args.metric_context, metric_hidden_size=args.metric_hidden_size)
    for model in (mha, damcha):  # `...LMHeadModel` names no loss: say it, rather than let transformers warn
        model.loss_type = "ForCausalLM"
    models = {"DAMCHA": damcha, "MHA": mha}
    # Warm-up then cosine decay to `plan["total"]` steps, which the time budget may lower after calibration.
    plan = {"total": args.max_steps, "warmup": max(1, min(CALIBRATION_STEPS, args.max_steps // 20))}

    def learning_rate_factor(step: int) -> float:
        if step < plan["warmup"]:
            return (step + 1) / plan["warmup"]
        progress = min(1.0, (step - plan["warmup"]) / max(1, plan["total"] - plan["warmup"]))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    optimizers, schedulers = {}, {}
    for name, model in models.items():
        model.train()
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
        schedulers[name] = torch.optim.lr_scheduler.LambdaLR(optimizers[name], learning_rate_factor)

    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(args.seed))
    if not args.num_threads:
        torch.set_num_threads(_fastest_thread_count(damcha, train_blocks[order[: args.batch_size]]))
    print(f"{torch.get_num_threads()} CPU thread(s); {sum(p.numel() for p in damcha.parameters()):,} parameters "
          f"(DAMCHA), {sum(p.numel() for p in mha.parameters()):,} (MHA)")  # fmt: skip
    histories = {name: [] for name in models}
    progress = tqdm(total=plan["total"], desc="training DAMCHA and MHA", disable=args.no_progress)
    step = 0
    training_started = timing_start = time.perf_counter()
    while step < plan["total"]:
        step += 1
        start = (step - 1) * args.batch_size % len(order)
        indices = order[start : start + args.batch_size]
        if len(indices) < args.batch_size:  # wrap around: a new pass over the data, same order for both models
            indices = torch.cat([indices, order[: args.batch_size - len(indices)]])
        batch = train_blocks[indices]
        losses = {}
        for name, model in models.items():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers[name].step()
            schedulers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name] = loss.item()
            histories[name].append(
                {"step": step, "loss": losses[name], "learning_rate": schedulers[name].get_last_lr()[0]}
            )
        progress.update(1)
        progress.set_postfix({f"{name} loss": f"{value:.3f}" for name, value in losses.items()})
        if step == WARMUP_TIMING_STEPS:
            timing_start = time.perf_counter()  # the first steps are slower (allocator, thread pools): skip them
        if args.time_budget > 0 and step >= CALIBRATION_STEPS and step & (step - 1) == 0:
            # Re-estimate at steps 16, 32, 64, ... while under 60% of the budget: other work on the machine changes
            # the pace. Both models share the plan, so the comparison stays exact.
            elapsed = time.perf_counter() - training_started
            if step == CALIBRATION_STEPS or elapsed < 0.6 * args.time_budget * 60:
                seconds_per_step = (time.perf_counter() - timing_start) / (step - WARMUP_TIMING_STEPS)
                # Evaluations cost about 3% on top of the steps; keep that margin.
                affordable = step + int((args.time_budget * 60 - elapsed) / seconds_per_step / 1.03)
                new_total = max(step, min(args.max_steps, affordable))
                if new_total != plan["total"]:
                    # Said once, and again only when the pace changed the plan by more than a fifth.
                    if step == CALIBRATION_STEPS or abs(new_total - plan["total"]) > 0.2 * plan["total"]:
                        progress.write(f"{seconds_per_step:.2f} s per step: {new_total} steps fit the "
                                       f"{args.time_budget:g}-minute budget (--time-budget)")  # fmt: skip
                    plan["total"] = progress.total = new_total
        if args.time_budget > 0 and time.perf_counter() - training_started > args.time_budget * 60 * 1.1:
            plan["total"] = progress.total = step  # far slower than measured: stop here (evaluated below)
        eval_every = args.eval_every or max(1, plan["total"] // 5)
        if step % eval_every == 0 or step == plan["total"]:
            for name, model in models.items():
                eval_loss, bits_per_byte = _evaluate(model, eval_blocks, args.batch_size)
                histories[name].append({"step": step, "eval_loss": eval_loss, "eval_bits_per_byte": bits_per_byte})
    progress.close()
    print(f"[{time.perf_counter() - started:.0f} s] trained")

    # Final numbers through the shipped evaluate module (the same NLL, counted in bytes).
    bits_per_byte_metric = load_metric("bits_per_byte", "nll")
    results = {}
    for name, model in models.items():
        eval_loss, _ = _evaluate(model, eval_blocks, args.batch_size)
        num_bytes = eval_blocks.shape[0] * (eval_blocks.shape[1] - 1)
        bpb = bits_per_byte_metric.compute(predictions=[eval_loss * num_bytes], references=[num_bytes])
        results[name] = {"eval_loss": eval_loss, "eval_bits_per_byte": bpb["bits_per_byte"]}
    print(f"\nvalidation after {step} steps ({eval_blocks.numel():,} bytes):")
    print(f"{'model':<8}{'loss (nats/byte)':>18}{'bits per byte':>15}")
    for name, row in results.items():
        print(f"{name:<8}{row['eval_loss']:>18.4f}{row['eval_bits_per_byte']:>15.4f}")
    difference = results["DAMCHA"]["eval_bits_per_byte"] - results["MHA"]["eval_bits_per_byte"]
    print(f"DAMCHA - MHA: {difference:+.4f} bits per byte (one seed: differences of about 0.01 are within noise)")

    damcha.eval()
    prompt = tokenizer(args.prompt, return_tensors="pt")
    room = args.block_size - prompt["input_ids"].shape[1]  # learned positions end at the context length
    torch.manual_seed(args.seed)
    with torch.no_grad():
        generated = damcha.generate(
            **prompt, max_new_tokens=max(1, min(args.sample_tokens, room)), do_sample=True, top_k=40, temperature=0.8,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)

    summary = {"steps": step, "results": results, "log_history": histories, "sample": sample}
    _save(damcha, tokenizer, args, histories, results, eval_blocks[:4], summary)
    print(f"\nsaved the DAMCHA model to {args.output_dir}")
    print(f"\nsample (prompt {args.prompt!r}):\n{sample}\n")
    print(f"({SAMPLE_NOTE})")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


SAMPLE_NOTE = (
    "a few minutes of CPU training of a small model: expect text with the shape of Python (indentation, keywords, "
    "brackets) that does not read as code yet; the comparison above is the demo's point. Longer runs "
    "(--time-budget, --max-steps) read better"
)


def _card_metrics(row: dict) -> dict:
    """A demo model's validation numbers as the card shows them: byte-level, so each is per byte."""
    return {"bits_per_byte": row["eval_bits_per_byte"], "loss_nats_per_byte": row["eval_loss"],
            "perplexity_per_byte": math.exp(row["eval_loss"])}  # fmt: skip


def _save(model, tokenizer, args, histories, results, heatmap_inputs, summary) -> None:
    """A Hub-ready checkpoint with the run's summary (`demo_results.json`) beside it, written as one folder swap."""
    import json

    from damcha_hf.hub import save_hub_checkpoint

    eval_results = _card_metrics(results["DAMCHA"])
    from damcha_hf.safe_files import public_dataset_name

    # A local path must not reach the card: a file or folder is named by its base name only.
    dataset = "python-stdlib-sources" if args.data == "stdlib" else public_dataset_name(args.data)
    save_hub_checkpoint(
        model, args.output_dir, tokenizer_or_processor=tokenizer, log_history=histories["DAMCHA"], datasets=[dataset] if dataset else None,
        heatmap_inputs=heatmap_inputs, eval_results=eval_results, model_name="damcha-demo", overwrite=True,
        extra_files={RESULTS_FILE: json.dumps(summary, indent=1) + "\n"},
        baseline_log_histories={"MHA baseline": histories["MHA"]},
        log_source="the demo's training loop (`damcha-hf demo`: both models in one loop, not the `Trainer`)",
        comparison={"MHA baseline (same run)": _card_metrics(results["MHA"])},
        notes=["The demo trains a small model for a few CPU minutes: a generated sample is not expected to read as "
               "code yet; the comparison with the MHA baseline is what the demo shows."],
    )  # fmt: skip
