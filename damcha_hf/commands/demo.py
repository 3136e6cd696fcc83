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

from damcha_hf import argument_checks as checks
from damcha_hf.modeling.damcha_config import METRIC_CONTEXTS
from damcha_hf.safe_files import check_checkpoint_folder
from damcha_hf.safe_files.atomic_files import hold_lock

RESULTS_FILE = "demo_results.json"
CAUSAL_METRIC_CONTEXTS = tuple(context for context in METRIC_CONTEXTS if context != "sequence")
DEFAULT_MAX_STEPS = 1000
DEFAULT_TIME_BUDGET_MINUTES = 6.0
DEFAULT_EVAL_BLOCKS = 1024
CALIBRATION_STEPS = 16
WARMUP_TIMING_STEPS = 4
EVALUATIONS = 5  # during training, for the loss curves
CURVE_EVAL_BLOCKS = 256  # of the validation blocks, evaluated during training (the final figures use them all)
# The demo trains on a few thousand of its 20,000+ blocks, so holding out a fifth of the documents costs it no text
# and spreads the validation blocks over some 30 documents rather than 8.
VALIDATION_FRACTION = 0.2
BOOTSTRAP_SAMPLES = 2000
EVAL_BATCH_FACTOR = 4  # evaluation batches are this many training batches: no gradients to keep, larger matrices
NEGLIGIBLE_BITS_PER_BYTE = 0.0005


def output_folder(text: str) -> str:
    """`--output-dir`: a new or empty folder, or an earlier demo checkpoint (replaced only with
    --overwrite-output-dir); a folder holding anything else is refused while parsing."""
    try:
        check_checkpoint_folder(text, argument="--output-dir")
    except OSError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
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
                        help="where the DAMCHA checkpoint goes: a new or empty folder; an earlier demo's output "
                        "needs --overwrite-output-dir; a folder holding other files is refused")  # fmt: skip
    parser.add_argument("--overwrite-output-dir", action="store_true",
                        help="replace the earlier demo checkpoint in --output-dir")  # fmt: skip
    parser.add_argument("--max-steps", type=checks.positive_int, default=DEFAULT_MAX_STEPS,
                        help=f"at most this many optimizer steps per model (default: {DEFAULT_MAX_STEPS})")  # fmt: skip
    parser.add_argument("--time-budget", type=checks.non_negative_float, default=DEFAULT_TIME_BUDGET_MINUTES,
                        help="minutes of training, evaluations included, for both models together (default: "
                        f"{DEFAULT_TIME_BUDGET_MINUTES:g}): the step count is planned after {CALIBRATION_STEPS} timed "
                        "steps, re-planned from the measured pace as training goes (so the schedule still anneals), "
                        "and training stops when the time is up; 0 = no limit, train --max-steps")  # fmt: skip
    parser.add_argument("--batch-size", type=checks.positive_int, default=16)
    parser.add_argument("--block-size", type=checks.positive_int, default=128,
                        help="context length in bytes (default: 128)")  # fmt: skip
    parser.add_argument("--n-layer", type=checks.positive_int, default=4)
    parser.add_argument("--n-embd", type=checks.positive_int, default=128)
    parser.add_argument("--n-head", type=checks.positive_int, default=8, help="must divide --n-embd (default: 8)")
    parser.add_argument("--metric-context", choices=CAUSAL_METRIC_CONTEXTS, default="token",
                        help="what the cross-head matrix C depends on ('sequence' would show a causal model the "
                        "future)")  # fmt: skip
    parser.add_argument("--metric-hidden-size", type=checks.positive_int, default=64)
    parser.add_argument("--learning-rate", type=checks.positive_float, default=3e-3)
    parser.add_argument("--max-data-bytes", type=checks.positive_int, default=3_000_000,
                        help="read about this many bytes of text (default: 3 MB)")  # fmt: skip
    parser.add_argument("--eval-blocks", type=checks.positive_int, default=DEFAULT_EVAL_BLOCKS,
                        help="validation blocks, drawn at random (with --seed) from the held-out documents; the "
                        f"comparison's interval narrows with more (default: {DEFAULT_EVAL_BLOCKS})")  # fmt: skip
    parser.add_argument("--eval-every", type=checks.positive_int, default=None,
                        help=f"evaluate every N steps (default: {EVALUATIONS} times)")  # fmt: skip
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
        model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss.backward()
        timings[threads] = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return min(timings, key=timings.get)


def block_nll(model, blocks, batch_size):
    """Mean NLL (nats per predicted byte) of each block of `blocks` (a LongTensor of token blocks), float64."""
    import torch

    from damcha_hf.metrics import causal_lm_token_nll

    model.eval()
    values = []
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start : start + batch_size]
            # Full blocks: every position attends. The mask says so, where the end-of-text token (also the padding
            # token) inside a block would otherwise draw transformers' "passing in an attention_mask" warning.
            logits = model(input_ids=batch, attention_mask=torch.ones_like(batch)).logits
            values.append(causal_lm_token_nll(logits, batch).double().mean(dim=1))
    model.train()
    return torch.cat(values)


def _evaluate(model, blocks, batch_size):
    """(mean NLL in nats per predicted byte, bits per byte) over `blocks`: every block predicts as many bytes, so
    the mean over blocks is the mean over bytes."""
    mean = block_nll(model, blocks, batch_size).mean().item()
    return mean, mean / math.log(2)


def paired_difference(first, second, *, seed: int, samples: int = BOOTSTRAP_SAMPLES, level: float = 0.95):
    """(mean of first - second, interval low, interval high): a percentile bootstrap over paired values (per-block
    losses of two models on the same blocks; each resample draws blocks, the same ones for both models)."""
    import torch

    differences = (first - second).double()
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(differences), (samples, len(differences)), generator=generator)
    means = differences[picks].mean(dim=1)
    quantiles = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=means.dtype)
    low, high = torch.quantile(means, quantiles).tolist()
    return differences.mean().item(), low, high


def verdict(low: float, high: float) -> str:
    """The comparison in words, from the interval of DAMCHA - MHA in bits per byte: resolved when the whole interval
    lies on one side of zero, beyond NEGLIGIBLE_BITS_PER_BYTE (below the table's precision: rounding, not learning)."""
    if high < -NEGLIGIBLE_BITS_PER_BYTE:
        return "DAMCHA lower, resolved"
    if low > NEGLIGIBLE_BITS_PER_BYTE:
        return "MHA lower, resolved"
    return "not resolved at this length"


class TimeBudget:
    """Fits training, its evaluations included, into `--time-budget` minutes.

    The step count is planned after CALIBRATION_STEPS timed steps and re-planned after every later step from the
    pace of the latest CALIBRATION_STEPS steps and the time the evaluations took (other work on the machine changes
    the pace), so the learning-rate schedule anneals by the end; training also stops when the time is up. Both models
    train the same steps, so the comparison stays exact whatever the plan.
    """

    def __init__(self, minutes: float, max_steps: int, clock=None):
        self.seconds = minutes * 60
        self.max_steps = max_steps
        self.clock = clock or time.perf_counter
        self.started = self.clock()
        self.step_seconds: list[float] = []  # from one step's end to the next's, evaluations left out
        self._last_step_end = self.started
        self.evaluation_seconds: list[float] = []
        self._evaluations_counted = 0  # of `evaluation_seconds`, already taken out of a step's time
        self.first_plan: int | None = None

    @property
    def limited(self) -> bool:
        return self.seconds > 0

    def step_done(self) -> None:
        """Record a training step: everything since the previous step ended, less the evaluations in between."""
        now = self.clock()
        evaluations = sum(self.evaluation_seconds[self._evaluations_counted :])
        self._evaluations_counted = len(self.evaluation_seconds)
        self.step_seconds.append(now - self._last_step_end - evaluations)
        self._last_step_end = now

    def elapsed(self) -> float:
        return self.clock() - self.started

    def pace(self) -> float:
        """Seconds per training step (both models), over the latest steps after the slower first ones."""
        recent = self.step_seconds[WARMUP_TIMING_STEPS:][-CALIBRATION_STEPS:] or self.step_seconds
        return sum(recent) / len(recent)

    def evaluation_cost(self, estimate: float) -> float:
        return sum(self.evaluation_seconds) / len(self.evaluation_seconds) if self.evaluation_seconds else estimate

    def plan(self, step: int, still_to_evaluate: float) -> int | None:
        """The step count that ends at the budget (None when there is no budget or no re-plan is due at `step`);
        `still_to_evaluate`: seconds of evaluation the rest of the run needs."""
        if not self.limited or step < CALIBRATION_STEPS:
            return None
        affordable = int((self.seconds - self.elapsed() - still_to_evaluate) / self.pace())
        total = max(step, min(self.max_steps, step + affordable))
        if self.first_plan is None:
            self.first_plan = total
        return total

    def out_of_time(self, reserve: float) -> bool:
        """The budget, less `reserve` seconds for what must follow (the last evaluations), is spent."""
        return self.limited and self.elapsed() >= self.seconds - reserve


def check_arguments(args: argparse.Namespace) -> None:
    """What depends on several arguments, checked before anything is imported or loaded."""
    message = checks.heads_divide_width_error(args.n_embd, args.n_head, width_flag="--n-embd", heads_flag="--n-head")
    if message:
        raise ValueError(message)
    if len(args.prompt.encode("utf-8")) >= args.block_size:
        raise ValueError(f"--prompt must be shorter than --block-size ({args.block_size} bytes).")
    folder = args.output_dir
    if os.path.isdir(folder) and any(os.scandir(folder)) and not args.overwrite_output_dir:
        raise ValueError(
            f"--output-dir {folder} holds an earlier demo run (its checkpoint and {RESULTS_FILE} would be replaced); "
            "pass --overwrite-output-dir to replace it, or choose another --output-dir"
        )


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    # One demo per output folder: the lock file sits beside the folder, which the save replaces as a whole.
    output = os.path.abspath(args.output_dir)
    lock_file = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.lock")
    lock = hold_lock(lock_file, what=f"--output-dir {args.output_dir}")
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
    from damcha_hf.data import byte_level_tokenizer, group_into_blocks, load_text_corpus, sample_blocks
    from damcha_hf.metrics import load_metric
    from damcha_hf.training import TrainingLoop, progress_bar_options

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)

    tokenizer = byte_level_tokenizer(model_max_length=args.block_size)
    corpus = load_text_corpus(
        args.data, validation_fraction=VALIDATION_FRACTION, seed=args.seed, max_bytes=args.max_data_bytes
    )
    separate_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    blocks = group_into_blocks(
        corpus, tokenizer, args.block_size, separate_documents=separate_documents, document_ids=True
    )
    train_blocks = torch.tensor(blocks["train"]["input_ids"])
    validation, documents = sample_blocks(blocks["validation"], args.eval_blocks, seed=args.seed)
    eval_blocks = torch.tensor(validation["input_ids"])
    curve_blocks = eval_blocks[:CURVE_EVAL_BLOCKS]
    held_out = "documents" if separate_documents else "sections of the text"
    validation_note = (f"{len(eval_blocks)} blocks of {args.block_size} bytes drawn at random (seed {args.seed}) from "
                       f"{documents} held-out {held_out}")  # fmt: skip
    print(f"[{time.perf_counter() - started:.0f} s] data: {args.data}: {len(train_blocks)} training blocks; "
          f"validation: {validation_note} (of {len(corpus['validation'])})")  # fmt: skip

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
    # Warm-up, then cosine decay to zero at `plan["total"]` steps, which the time budget re-plans as training goes.
    plan = {"total": args.max_steps}
    loops = {
        name: TrainingLoop(
            model, args.learning_rate, args.max_steps, warmup=max(1, min(CALIBRATION_STEPS, args.max_steps // 20)),
            final_fraction=0.0, weight_decay=0.01, decays=lambda _name, _parameter: True, betas=(0.9, 0.999),
        )
        for name, model in models.items()
    }  # fmt: skip

    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(args.seed))
    if not args.num_threads:
        torch.set_num_threads(_fastest_thread_count(damcha, train_blocks[order[: args.batch_size]]))
    print(f"{torch.get_num_threads()} CPU thread(s); {sum(p.numel() for p in damcha.parameters()):,} parameters "
          f"(DAMCHA), {sum(p.numel() for p in mha.parameters()):,} (MHA)")  # fmt: skip
    histories = {name: [] for name in models}
    progress = tqdm(total=plan["total"], desc="training DAMCHA and MHA", disable=args.no_progress,
                    **progress_bar_options())  # fmt: skip
    budget = TimeBudget(args.time_budget, args.max_steps)
    eval_batch_size = args.batch_size * EVAL_BATCH_FACTOR

    def evaluation_seconds_left(evaluations_done: int) -> float:
        """The curve evaluations still due and the final one on every validation block, at the measured cost."""
        # Until measured: a forward pass of both models costs about 0.4 of a training step, per batch.
        curve = budget.evaluation_cost(0.4 * budget.pace() * math.ceil(len(curve_blocks) / args.batch_size))
        curves_left = max(1, EVALUATIONS - evaluations_done) if not args.eval_every else 1
        return curve * (curves_left + len(eval_blocks) / len(curve_blocks))

    step = evaluations_done = 0
    stopped_on_clock = False
    while step < plan["total"]:
        step += 1
        start = (step - 1) * args.batch_size % len(order)
        indices = order[start : start + args.batch_size]
        if len(indices) < args.batch_size:  # wrap around: a new pass over the data, same order for both models
            indices = torch.cat([indices, order[: args.batch_size - len(indices)]])
        batch = train_blocks[indices]
        losses = {}
        for name, loop in loops.items():
            learning_rate = loop.learning_rate()
            losses[name] = loop.step(
                {"input_ids": batch, "attention_mask": torch.ones_like(batch), "labels": batch}, label=name
            )
            histories[name].append({"step": step, "loss": losses[name], "learning_rate": learning_rate})
        progress.update(1)
        progress.set_postfix({f"{name} loss": f"{value:.3f}" for name, value in losses.items()}, refresh=False)
        budget.step_done()
        new_total = budget.plan(step, evaluation_seconds_left(evaluations_done))
        if new_total is not None:
            if step == CALIBRATION_STEPS:
                progress.write(f"plan: {new_total} steps fit the {args.time_budget:g}-minute budget at "
                               f"{budget.pace():.2f} s per step for both models, evaluations included; re-planned "
                               "at every step from the measured pace, and stopped when the time is up "
                               "(--time-budget)")  # fmt: skip
            plan["total"] = progress.total = new_total
            for loop in loops.values():
                loop.total_steps = new_total
        if step < plan["total"] and budget.out_of_time(reserve=evaluation_seconds_left(EVALUATIONS - 1)):
            plan["total"] = progress.total = step  # slower than measured: stop here (evaluated below)
            stopped_on_clock = True
        due = (
            step % args.eval_every == 0
            if args.eval_every
            else step * EVALUATIONS >= (evaluations_done + 1) * plan["total"]
        )
        if due or step == plan["total"]:
            evaluation_started = time.perf_counter()
            for name, model in models.items():
                eval_loss, bits_per_byte = _evaluate(model, curve_blocks, eval_batch_size)
                histories[name].append({"step": step, "eval_loss": eval_loss, "eval_bits_per_byte": bits_per_byte})
            budget.evaluation_seconds.append(time.perf_counter() - evaluation_started)
            # When a re-plan shortened the run, the evaluations it moved into the past are skipped, not caught up.
            evaluations_done = max(evaluations_done + 1, step * EVALUATIONS // plan["total"])
    progress.close()

    # Final numbers on every validation block, through the shipped evaluate module (the same NLL, counted in bytes).
    bits_per_byte_metric = load_metric("bits_per_byte", "nll")
    per_block, results = {}, {}
    final_evaluation_started = time.perf_counter()
    for name, model in models.items():
        per_block[name] = block_nll(model, eval_blocks, eval_batch_size)
        eval_loss = per_block[name].mean().item()
        num_bytes = eval_blocks.shape[0] * (eval_blocks.shape[1] - 1)
        bpb = bits_per_byte_metric.compute(predictions=[eval_loss * num_bytes], references=[num_bytes])
        results[name] = {"eval_loss": eval_loss, "eval_bits_per_byte": bpb["bits_per_byte"]}
    final_evaluation_seconds = time.perf_counter() - final_evaluation_started
    training_seconds = budget.elapsed()
    minutes, seconds = divmod(training_seconds, 60)
    if budget.limited:
        how = "stopped on the clock" if stopped_on_clock else "as planned"
        print(f"[{time.perf_counter() - started:.0f} s] trained {step} steps and evaluated in {minutes:.0f} min "
              f"{seconds:.0f} s of the {args.time_budget:g}-minute budget ({how}; first plan {budget.first_plan} "
              "steps)")  # fmt: skip
    else:
        print(f"[{time.perf_counter() - started:.0f} s] trained {step} steps and evaluated in {minutes:.0f} min "
              f"{seconds:.0f} s (no time budget)")  # fmt: skip

    print(f"\nvalidation after {step} steps: {validation_note}")
    print(f"{'model':<8}{'loss (nats/byte)':>18}{'bits per byte':>15}")
    for name, row in results.items():
        print(f"{name:<8}{row['eval_loss']:>18.4f}{row['eval_bits_per_byte']:>15.4f}")
    to_bits = 1 / math.log(2)
    difference, low, high = paired_difference(per_block["DAMCHA"] * to_bits, per_block["MHA"] * to_bits, seed=args.seed)
    comparison = {"difference_bits_per_byte": difference, "interval_95": [low, high], "verdict": verdict(low, high),
                  "blocks": len(eval_blocks), "documents": documents}  # fmt: skip
    print(f"DAMCHA - MHA: {difference:+.4f} bits per byte, 95% interval [{low:+.4f}, {high:+.4f}]: "
          f"{comparison['verdict']}")  # fmt: skip
    print(f"  (a paired bootstrap over the {len(eval_blocks)} validation blocks, the same blocks for both models: it "
          "says how much the figure depends on which blocks were drawn, for this one training run. Another --seed "
          "trains another pair of models, whose difference can move by more than this interval: compare several "
          "seeds before drawing a conclusion about DAMCHA)")  # fmt: skip

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

    timing = {"budget_seconds": budget.seconds, "seconds": training_seconds, "first_plan": budget.first_plan,
              "stopped_on_clock": stopped_on_clock, "final_evaluation_seconds": final_evaluation_seconds,
              "curve_evaluation_seconds": budget.evaluation_seconds}  # fmt: skip
    summary = {"steps": step, "results": results, "comparison": comparison, "validation": validation_note,
               "time": timing, "log_history": histories, "sample": sample}  # fmt: skip
    # The loss curves' points are evaluations on the first CURVE_EVAL_BLOCKS of the validation blocks; the figures
    # above on all of them: the card says so where the two differ (under the training table and under the evaluation
    # table, so the sentence names no direction).
    log_evaluation = (
        f"on the first {len(curve_blocks)} of the {len(eval_blocks)} validation blocks (the loss curve's points); the "
        f"evaluation results use all {len(eval_blocks)}"
        if len(curve_blocks) < len(eval_blocks)
        else None
    )
    _save(damcha, tokenizer, args, histories, results, summary, validation_note, log_evaluation)
    print(f"\nsaved the DAMCHA model to {args.output_dir}\n\n{how_to_load(args.output_dir)}")
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


def how_to_load(folder: str) -> str:
    """The lines that load the demo's checkpoint from `folder`, with the plugin and without it (the card's snippets)."""
    import textwrap

    from damcha_hf.hub.model_card import TOKENIZER_SUBFOLDER, loading_snippet

    def snippet(plugin: bool) -> str:
        code = loading_snippet("AutoModelForCausalLM", folder, "gpt2", True, plugin=plugin,
                               tokenizer_subfolder=TOKENIZER_SUBFOLDER)  # fmt: skip
        return textwrap.indent(code, "    ")

    return (
        f"load it with the plugin:\n\n{snippet(plugin=True)}\n\nor without it (the checkpoint carries its model "
        f"code; read it first, it runs on your machine; the tokenizer loads from its {TOKENIZER_SUBFOLDER}/ "
        f"subfolder without remote code):\n\n{snippet(plugin=False)}\n\n"
        f"(the model card, {os.path.join(folder, 'README.md')}, says the same; `damcha-hf push {folder} "
        "<namespace/name>` uploads it)"
    )


def _save(model, tokenizer, args, histories, results, summary, validation_note, log_evaluation=None) -> None:
    """A Hub-ready checkpoint with the run's summary (`demo_results.json`) beside it, written as one folder swap. The
    metric heatmap uses the built-in sample that `damcha-hf inspect` uses by default, so both give the same figures."""
    import json

    from damcha_hf.hub import save_hub_checkpoint
    from damcha_hf.hub.file_rules import public_dataset_name

    eval_results = _card_metrics(results["DAMCHA"])
    # A local path must not reach the card: a file or folder is named by its base name only.
    dataset = "python-stdlib-sources" if args.data == "stdlib" else public_dataset_name(args.data)
    save_hub_checkpoint(
        model, args.output_dir, tokenizer_or_processor=tokenizer, log_history=histories["DAMCHA"], datasets=[dataset] if dataset else None,
        eval_results=eval_results, model_name="damcha-demo", overwrite=True,
        extra_files={RESULTS_FILE: json.dumps(summary, indent=1) + "\n"},
        baseline_log_histories={"MHA baseline": histories["MHA"]},
        log_source="the demo's training loop (`damcha-hf demo`: both models in one loop, not the `Trainer`)",
        comparison={"MHA baseline (same run)": _card_metrics(results["MHA"])},
        local_folder=args.output_dir, log_evaluation=log_evaluation,
        notes=["The demo trains a small model for a few CPU minutes: a generated sample is not expected to read as "
               "code yet; the comparison with the MHA baseline is what the demo shows.",
               f"Validation figures (both models): {validation_note} of {dataset or 'the training text'}, none of "
               f"them seen in training; the DAMCHA - MHA difference is {summary['comparison']['verdict']} "
               f"({summary['comparison']['difference_bits_per_byte']:+.4f} bits per byte, 95% bootstrap interval "
               f"[{summary['comparison']['interval_95'][0]:+.4f}, {summary['comparison']['interval_95'][1]:+.4f}])."],
    )  # fmt: skip
