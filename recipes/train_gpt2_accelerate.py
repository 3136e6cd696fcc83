#!/usr/bin/env python
r"""Pretrain a DAMCHA GPT-2 or Llama with a plain Accelerate loop: the models, data and metrics of `train_gpt2.py`.

One process:
    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml \
        recipes/train_gpt2_accelerate.py --data corpus.txt --output-dir runs/gpt2-acc
    ... recipes/train_gpt2_accelerate.py --model-type damcha_llama --n-head 8 --n-kv-head 2   # Llama, grouped-query
Several CPU processes (DDP over gloo; every process keeps identical weights):
    accelerate launch --config_file recipes/accelerate_configs/cpu_ddp_2proc.yaml recipes/train_gpt2_accelerate.py
    accelerate launch --multi_gpu --num_processes 2 recipes/train_gpt2_accelerate.py    # the same, without a file
(`accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.x unless it finds `mpirun`: its
launcher for several local processes is torchrun, which `--multi_gpu` selects; on a machine without GPUs this
recipe then runs every process on the CPU with the gloo backend.)
GPUs (DDP), or FSDP sharding the DAMCHA blocks:
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/train_gpt2_accelerate.py
    accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml recipes/train_gpt2_accelerate.py
(Accelerate enables FSDP only on GPUs and other accelerators: on CPU it drops the FSDP plugin and runs DDP, so this
recipe refuses an FSDP launch without one rather than silently training unsharded.)
Resume the latest `checkpoint-N` (model, optimizer, scheduler, RNG and data position):
    accelerate launch ... recipes/train_gpt2_accelerate.py --output-dir runs/gpt2-acc --resume
Data through `datasets`, as run_clm.py takes it (the flags of `train_gpt2.py`: --dataset-name, --train-file, ...);
with `--streaming` the text is tokenized and packed as it trains, and each process takes its own share of the stream
(`datasets.distributed.split_dataset_by_node`: whole files when their number divides evenly among the processes, else
every N-th packed block; give as many parquet files as processes, or a multiple, so that each reads only its own).
Each checkpoint records how many blocks of its share every process has consumed, and a resume skips them:
    accelerate launch --config_file recipes/accelerate_configs/cpu_ddp_2proc.yaml recipes/train_gpt2_accelerate.py \
        --train-file corpus.parquet --streaming --max-steps 1000

`--batch-size` is per process. At the end every process writes the SHA-256 of its parameters to
`<output-dir>/parameter_sha256_rank<N>.txt` (they must all agree under DDP; under FSDP, where each process holds a
shard, the main process writes that of the gathered parameters); the main process saves the model and tokenizer to
`<output-dir>/final` and the evaluation to `<output-dir>/eval_results.json`.

On `--resume`, the checkpoint's model settings (`--model-type` included) win: a model flag left out takes the
checkpoint's value, one given with a different value is refused (naming every such flag).
"""

import argparse
import hashlib
import logging
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import recipe_options  # standard library only: torch, transformers and accelerate are imported after parsing
import run_folder
import text_data

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import atomic_files, checkpoint_checks

STATE_FILE = "loop_state.json"
# What `Accelerator.save_state` writes besides the weights (file pattern: what it is), checked before a resume.
RESUME_STATE = {"optimizer.bin": "optimizer state", "scheduler.bin": "learning-rate schedule",
                "random_states_*.pkl": "random number generator state"}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    text_data.add_text_data_arguments(parser)
    text_data.add_gpt2_size_arguments(parser)
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/accelerate-{settings}", batch_size=16, learning_rate=2e-3,
                                          max_steps=1000, output_dir_example="runs/accelerate-damcha_gpt2-stdlib-byte")  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=text_data.language_model_run_name)
    text_data.check_text_data_arguments(parser, args)
    recipe_options.check_causal_metric_context(parser, args)
    text_data.check_new_language_model_sizes(parser, args)
    recipe_options.check_language_model_variant_flags(parser, args)
    return args


def parameter_sha256(model, state_dict: dict | None = None) -> str:
    """SHA-256 over the model's parameters by name (a tied weight counts once), read from `state_dict` when given
    (the gathered full parameters of an FSDP model, whose own parameters are this process's shards)."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        value = parameter if state_dict is None else state_dict[name]
        digest.update(name.encode())
        digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def evaluate(model, loader, accelerator, byte_lengths) -> dict:
    """Validation perplexity and bits per byte, summed over every process's share before dividing."""
    import torch

    with torch.no_grad():
        return _evaluate(model, loader, accelerator, byte_lengths)


def _evaluate(model, loader, accelerator, byte_lengths) -> dict:
    import torch

    from damcha_hf.metrics import causal_lm_token_nll, load_metric

    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # nll (nats), tokens, bytes
    for batch in loader:
        logits = model(input_ids=batch["input_ids"]).logits
        nll = causal_lm_token_nll(logits, batch["labels"]).double()
        targets = batch["labels"][:, 1:]
        scored = targets != -100
        totals += torch.stack(
            [nll[scored].sum(), scored.sum().double(), byte_lengths.to(targets.device)[targets[scored]].sum().double()]
        )
    totals = accelerator.reduce(totals, reduction="sum")
    model.train()
    total_nll, num_tokens, num_bytes = totals.tolist()
    results = load_metric("perplexity", "nll").compute(predictions=[total_nll], references=[int(num_tokens)])
    results.update(load_metric("bits_per_byte", "nll").compute(predictions=[total_nll], references=[int(num_bytes)]))
    return {"eval_loss": results["mean_nll"], "eval_perplexity": results["perplexity"],
            "eval_bits_per_byte": results["bits_per_byte"]}  # fmt: skip


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume = run_folder.resolve_resume(args.resume, args.output_dir, marker=STATE_FILE)
    load_state = run_folder.check_resume_state(args, resume, RESUME_STATE, marker=STATE_FILE)
    text_data.check_language_model_resume(args, resume)
    datasets = run_folder.card_datasets(text_data.data_label(args))  # what the card will say, settled before training
    recipe_options.check_push(args, accelerate=True)
    run = run_folder.start_run(args, resume)

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedType, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, default_data_collator, get_scheduler

    from damcha_hf.data import check_tokenizer_matches_model, token_byte_lengths

    accelerator = Accelerator(
        # Without a GPU, run on CPU: several processes then join over gloo (multi-CPU DDP).
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="bf16" if args.bf16 else None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # --report-to: TensorBoard writes to <output-dir>/runs/<run name>, as under the Trainer.
        log_with=args.report_to or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, run_folder.TRACKER_LOGS)),
    )  # fmt: skip
    check_fsdp_runs(accelerator, DistributedType)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    set_seed(args.seed)
    if resume and os.path.isfile(os.path.join(resume, "tokenizer.json")):
        text_data.check_resume_tokenizer(args, resume)
        args.tokenizer = resume

    # The main process tokenises first and fills the datasets cache; the others then read it.
    with accelerator.main_process_first():
        corpus = text_data.load_language_model_corpus(args)
        tokenizer = text_data.build_tokenizer(args, corpus)
        if args.streaming:  # each process tokenizes and packs its own share of the stream as it trains
            train, validation = text_data.streaming_language_model_data(
                args, tokenizer, corpus, rank=accelerator.process_index, world_size=accelerator.num_processes
            )
        else:
            train, validation = text_data.language_model_data(args, tokenizer, corpus)
    train, validation = train.with_format("torch"), validation.with_format("torch")

    model = AutoModelForCausalLM.from_config(text_data.language_model_config(args, len(tokenizer), tokenizer))
    check_tokenizer_matches_model(tokenizer, model.config)
    text_data.use_causal_lm_loss(model)
    training = "training blocks streamed" if args.streaming else f"{len(train)} training blocks"
    accelerator.print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {training}; "
                      f"{accelerator.num_processes} process(es)")  # fmt: skip

    if args.streaming:
        # Not prepared: the stream is already this process's share (split_dataset_by_node), which Accelerate would
        # otherwise split again by batches.
        train_loader = None
    else:
        train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=default_data_collator)
    eval_loader = DataLoader(validation, batch_size=args.batch_size, collate_fn=default_data_collator)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "ln_" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "ln_" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
    )
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
    # A prepared scheduler steps once per process per optimizer step, so its horizon is scaled to match.
    scheduler = get_scheduler(
        "cosine", optimizer, num_warmup_steps=warmup * accelerator.num_processes,
        num_training_steps=args.max_steps * accelerator.num_processes,
    )  # fmt: skip
    if train_loader is None:
        model, optimizer, eval_loader, scheduler = accelerator.prepare(model, optimizer, eval_loader, scheduler)
    else:
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler
        )
    byte_lengths = torch.as_tensor(token_byte_lengths(tokenizer))
    model_config = accelerator.unwrap_model(model).config.to_dict()  # saved with each checkpoint, checked on resume

    hyperparameters = {key: value for key, value in vars(args).items() if isinstance(value, (int, float, str, bool))}
    accelerator.init_trackers(os.path.basename(os.path.normpath(args.output_dir)), config=hyperparameters)

    step, log_history, stream_position = 0, [], {"pass": 0, "blocks": 0}
    if resume and load_state:
        accelerator.load_state(resume)
    elif resume:  # --resume-weights-only: the weights and the step; a new optimizer, schedule and random state
        from safetensors.torch import load_model

        load_model(accelerator.unwrap_model(model), os.path.join(resume, "model.safetensors"),
                   device=str(accelerator.device))  # fmt: skip
    if resume:
        saved = checkpoint_checks.read_json_file(os.path.join(resume, STATE_FILE), "the training state")
        step, log_history = saved["step"], saved["log_history"]
        if args.streaming:
            positions = saved.get("stream_positions")
            if positions is None:
                raise ValueError(f"--resume {resume}: the checkpoint was not trained with --streaming (it records no "
                                 "stream position); resume it without --streaming, or start a new run")  # fmt: skip
            if len(positions) != accelerator.num_processes:
                raise ValueError(f"--resume {resume}: the stream was read by {len(positions)} process(es), each its "
                                 f"own share, not {accelerator.num_processes}; resume with {len(positions)}")  # fmt: skip
            stream_position = positions[accelerator.process_index]
        accelerator.print(f"resumed from {resume} at step {step}")

    eval_steps, save_steps = recipe_options.evaluation_schedule(args)  # a quick run evaluates and saves at the end only
    from tqdm.auto import tqdm

    shown = accelerator.is_local_main_process and recipe_options.live_progress_bar()
    progress = tqdm(total=args.max_steps, initial=step, desc="training", disable=not shown)

    def report(entry: dict) -> None:
        accelerator.log({key: value for key, value in entry.items() if key != "step"}, step=entry["step"])
        if accelerator.is_local_main_process:
            progress.write(str(entry))

    model.train()
    running_loss, running_count = 0.0, 0

    def train_step(batch) -> None:
        nonlocal running_loss, running_count
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        running_loss += accelerator.reduce(loss.detach(), reduction="mean").item()
        running_count += 1

    def after_optimizer_step() -> bool:
        """Log, evaluate and checkpoint as the schedule says; True once --max-steps is reached."""
        nonlocal running_loss, running_count
        progress.update(1)
        if step % args.logging_steps == 0 or step == args.max_steps:
            entry = {"step": step, "loss": running_loss / running_count, "learning_rate": scheduler.get_last_lr()[0]}
            log_history.append(entry)
            report(entry)
            progress.set_postfix(loss=f"{entry['loss']:.3f}", refresh=False)
            running_loss, running_count = 0.0, 0
        if (eval_steps and step % eval_steps == 0) or step == args.max_steps:
            entry = {"step": step, **evaluate(model, eval_loader, accelerator, byte_lengths)}
            log_history.append(entry)
            report(entry)
        if step % save_steps == 0 or step == args.max_steps:
            position = dict(stream_position) if args.streaming else None
            save_checkpoint(accelerator, tokenizer, run, step, log_history, model_config, position)
        return step >= args.max_steps

    def training_batches():
        """The batches still to train on: the stream past what was seen, or the epochs from the resumed step on."""
        if args.streaming:
            yield from streamed_batches(train, args, accelerator, stream_position)
            return
        steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
        while step < args.max_steps:  # `step` as the loop below has advanced it
            epoch, done_in_epoch = divmod(step, steps_per_epoch)
            train_loader.set_epoch(epoch)
            yield from accelerator.skip_first_batches(train_loader, done_in_epoch * args.gradient_accumulation_steps)

    for batch in training_batches():
        train_step(batch)
        if not accelerator.sync_gradients:
            continue
        step += 1
        if after_optimizer_step():
            break

    progress.close()
    results = evaluate(model, eval_loader, accelerator, byte_lengths)
    results.update(global_step=step, resumed_from=resume, num_processes=accelerator.num_processes)
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)  # gathers FSDP shards onto the main process; every process calls it
    sharded = accelerator.distributed_type == DistributedType.FSDP  # the unwrapped model holds only this shard
    if accelerator.is_main_process or not sharded:
        checksum = parameter_sha256(unwrapped, state_dict if sharded else None)
        os.makedirs(args.output_dir, exist_ok=True)
        atomic_files.atomic_write(
            os.path.join(args.output_dir, f"parameter_sha256_rank{accelerator.process_index}.txt"), checksum + "\n"
        )
        print(f"[rank {accelerator.process_index}] parameter sha256 {checksum}", flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final_model = unwrapped
        if sharded:  # rebuilt whole from the gathered weights: the card's metric heatmap runs the model on this process
            final_model = AutoModelForCausalLM.from_config(unwrapped.config)
            final_model.load_state_dict(state_dict)
        final = os.path.join(args.output_dir, "final")
        run_folder.save_final_model(final_model, final, tokenizer_or_processor=tokenizer, log_history=log_history,
                                    datasets=datasets)  # fmt: skip
        results["eval_documents"] = args.validation_documents
        atomic_files.write_json(os.path.join(args.output_dir, "eval_results.json"), results)
        print(results)
        run_folder.push_final_model(args, final)
    accelerator.end_training()
    return results


def check_fsdp_runs(accelerator, DistributedType) -> None:
    """Refuse an FSDP launch that Accelerate turned into DDP: without a GPU (or other accelerator) Accelerate builds
    a multi-CPU state and drops the FSDP plugin, which would train every process on the full model."""
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and accelerator.distributed_type != DistributedType.FSDP:
        raise ValueError(
            f"the launch config asks for FSDP (distributed_type: FSDP), but Accelerate runs it as "
            f"{accelerator.distributed_type.value}: Accelerate enables FSDP only on GPUs and other accelerators. On "
            "CPU, launch with recipes/accelerate_configs/cpu_ddp_2proc.yaml (DDP over gloo) instead"
        )


class TiedWeightsNotice(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {'lm_head.weight'} while saving" line, printed at every save: GPT-2's
    output layer is tied to the token embedding, so safetensors stores it once and loading ties it again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor {'lm_head.weight'}" not in record.getMessage()  # after a [RANK n] prefix


TIED_WEIGHTS_NOTICE = TiedWeightsNotice()  # one instance, so that each save does not add another filter


def skip_first(rows, count: int):
    """`rows` after their first `count`, counted in this process's share: `IterableDataset.skip` would count in the
    stream before `split_dataset_by_node` divides it (every N-th block to each process), skipping too few."""
    import itertools

    import torch

    class Skipped(torch.utils.data.IterableDataset):
        def __iter__(self):
            return itertools.islice(iter(rows), count, None)

    return Skipped()


def streamed_batches(blocks, args, accelerator, position: dict):
    """Batches of this process's streamed blocks, forever: a pass that ends on any process ends on all of them (the
    shares can differ in length, and a process that stopped alone would leave the others waiting), and the next pass
    starts over. `position` ({"pass", "blocks"}: blocks of this process's share consumed in the current pass) is
    updated as batches are handed out and saved with each checkpoint; a resumed run skips the blocks it counts."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    while True:
        blocks.set_epoch(position["pass"])
        loader = DataLoader(skip_first(blocks, position["blocks"]), batch_size=args.batch_size,
                            collate_fn=default_data_collator)  # fmt: skip
        iterator, yielded = iter(loader), 0
        while True:
            batch = next(iterator, None)
            # Every process learns whether any ran out, so that all end the pass at the same batch.
            exhausted = torch.tensor([batch is None], dtype=torch.int64, device=accelerator.device)
            if accelerator.reduce(exhausted, reduction="sum").item():
                break
            position["blocks"] += len(batch["input_ids"])
            yielded += 1
            yield {name: value.to(accelerator.device) for name, value in batch.items()}
        if yielded == 0 and position["blocks"] == 0:
            raise ValueError("the training stream holds fewer tokens than one block on some process; give more text, "
                             "a smaller --block-size, or fewer processes")  # fmt: skip
        position["pass"], position["blocks"] = position["pass"] + 1, 0


def save_checkpoint(
    accelerator, tokenizer, run, step: int, log_history: list, model_config: dict, stream_position: dict | None = None
) -> None:
    """`checkpoint-<step>`: every process's part of the state, the tokenizer and the loop state, named in the run record
    before any process writes it, and its files recorded with the run's id once all are written (`run_folder.Run`), which
    also keeps only the newest --save-total-limit of the run's checkpoints."""
    folder = os.path.join(run.output_dir, f"checkpoint-{step}")
    if accelerator.is_main_process:
        run.writing(folder)
    accelerator.wait_for_everyone()
    logging.getLogger("accelerate.utils.other").addFilter(TIED_WEIGHTS_NOTICE)
    accelerator.save_state(folder)
    if stream_position is not None:
        from accelerate.utils import gather_object

        # Each process's own count: the last batch of a pass can be shorter on one process than on another.
        stream_positions = gather_object([stream_position])
    if accelerator.is_main_process:
        tokenizer.save_pretrained(folder)
        state = {"step": step, "log_history": log_history, "model_config": model_config}
        if stream_position is not None:
            state["stream_positions"] = stream_positions  # by process index
        atomic_files.write_json(os.path.join(folder, STATE_FILE), state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        run.wrote(folder)


if __name__ == "__main__":
    recipe_options.run_recipe(main)
