#!/usr/bin/env python
"""Supervised fine-tuning of a pretrained decoder, converted to DAMCHA, with TRL's `SFTTrainer` on chat data.

    pip install -e ".[trl]"
    python recipes/train_sft.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --train-file chats.jsonl \\
        --assistant-only-loss --packing
    python recipes/train_sft.py --model-name-or-path path/to/llama --train-file chats.jsonl --lora   # LoRA

`--train-file` (and `--validation-file`) is JSON lines, one conversation per line, in TRL's conversational format:
`{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}`, or its
prompt-completion form `{"prompt": [...user turns...], "completion": [...the assistant's reply...]}`, trained on the
completion only (completion-only loss). Each conversation is rendered with the tokenizer's chat template; `--assistant-only-loss` trains on the assistant turns alone (the template
marks them with `{% generation %}`, or TRL supplies a training template for the common ones), `--packing` packs the
conversations into `--max-length` rows without padding (each keeps its own positions and attends only to itself).

A stock GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2 checkpoint is converted to DAMCHA first (every weight
kept, outputs unchanged before the first step; the --metric-* flags choose the conversion); a DAMCHA checkpoint is
fine-tuned as it is. With `--lora`, LoRA adapts the attention and MLP projections (TRL's `peft_config`) and the metric
generator trains in full (PEFT `modules_to_save`); the adapter goes to `<output-dir>/adapter` and the merged model to
`<output-dir>/final`, a Hub-ready checkpoint with the tokenizer (chat template included) that loads without the plugin
(`trust_remote_code=True`).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrained_model  # standard library only: torch, transformers and trl are imported after the arguments are parsed
import recipe_options
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf.optional_packages import check_extras

DECODERS = "GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2"
ROW_EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout")


PAIR_EXAMPLE = (
    '{"prompt": [{"role": "user", "content": "..."}], "completion": [{"role": "assistant", "content": "..."}]}'
)
# The two conversational formats of TRL: the columns each row holds.
FORMATS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion")}


def check_turns(where: str, field: str, turns) -> None:
    if not isinstance(turns, list) or not turns:
        raise argparse.ArgumentTypeError(f'{where}: "{field}" is not a list of messages; e.g. {ROW_EXAMPLE}, or '
                                         f"{PAIR_EXAMPLE}")  # fmt: skip
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            raise argparse.ArgumentTypeError(f'{where}: a message of "{field}" without "role" and "content"; write '
                                             'each turn as {"role": "user", "content": "..."}')  # fmt: skip


def row_format(text: str) -> str:
    """The conversational format of a checked --train-file / --validation-file (`chat_file`): a key of FORMATS."""
    with open(text, encoding="utf-8") as handle:
        row = json.loads(next(line for line in handle if line.strip()))
    return "messages" if "messages" in row else "prompt-completion"


def chat_file(text: str) -> str:
    """--train-file / --validation-file: JSON lines of conversations in one of TRL's conversational formats, every
    row in the same one; the first faulty line is named."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file; give a JSON-lines file of {ROW_EXAMPLE} rows")
    rows, first = 0, None
    with open(text, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{text}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(f"{where}: not JSON ({error.msg}); write one object per line, e.g. "
                                                 f"{ROW_EXAMPLE}") from None  # fmt: skip
            found = next((name for name, fields in FORMATS.items()
                          if isinstance(row, dict) and all(field in row for field in fields)), None)  # fmt: skip
            if found is None:
                raise argparse.ArgumentTypeError(f'{where}: no "messages" list (nor "prompt" and "completion"); each '
                                                 f"line is a conversation, e.g. {ROW_EXAMPLE}")  # fmt: skip
            first = first or found
            if found != first:
                raise argparse.ArgumentTypeError(f"{where}: a {found} row after {first} rows; write every row in one "
                                                 "format")  # fmt: skip
            for field in FORMATS[found]:
                check_turns(where, field, row[field])
            replies = row["messages"] if found == "messages" else row["completion"]
            if not any(turn["role"] == "assistant" for turn in replies):
                raise argparse.ArgumentTypeError(f'{where}: no "assistant" turn, so nothing to learn from it; add the '
                                                 "reply, or remove the line")  # fmt: skip
            rows += 1
    if not rows:
        raise argparse.ArgumentTypeError(f"{text} holds no conversations; write one {ROW_EXAMPLE} per line")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    pretrained_model.add_pretrained_argument(parser, DECODERS)
    data = parser.add_argument_group("data")
    data.add_argument("--train-file", required=True, type=chat_file,
                      help=f"JSON lines of {ROW_EXAMPLE} (or of {PAIR_EXAMPLE}: the loss on the completion only)")  # fmt: skip
    data.add_argument("--validation-file", type=chat_file,
                      help="held-out conversations (default: --validation-fraction of --train-file)")  # fmt: skip
    data.add_argument("--validation-fraction", type=checks.probability, default=0.05,
                      help="share of --train-file held out when no --validation-file is given (at least one row)")  # fmt: skip
    data.add_argument("--max-length", type=checks.positive_int, default=1024,
                      help="tokens per conversation (truncated), or per packed row with --packing (default: 1024, at "
                      "most the model's context)")  # fmt: skip
    data.add_argument("--packing", action="store_true",
                      help="pack conversations into --max-length rows without padding (TRL's best-fit packing)")  # fmt: skip
    data.add_argument("--assistant-only-loss", action="store_true",
                      help="messages rows: train on the assistant turns only (default: every token of the "
                      "conversation); prompt-completion rows always train on the completion only")  # fmt: skip
    lora = parser.add_argument_group("LoRA (with --lora)")
    lora.add_argument("--lora", action="store_true",
                      help="LoRA on the family's attention and MLP projections, the metric generator trained in full")  # fmt: skip
    lora.add_argument("--lora-rank", type=checks.positive_int)
    lora.add_argument("--lora-alpha", type=checks.positive_float)
    lora.add_argument("--lora-dropout", type=checks.probability)
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/sft-{settings}", batch_size=8, learning_rate=2e-5,
                                          max_steps=500, output_dir_example="runs/sft-Qwen_Qwen2.5-0.5B-chats for "
                                          "--model-name-or-path Qwen/Qwen2.5-0.5B --train-file chats.jsonl")  # fmt: skip
    parser.parse_known_args(argv)  # --help answers without trl
    check_extras(parser, "recipes/train_sft.py", "trl")
    args = recipe_options.parse_checked(parser, argv, run_name=lambda args: recipe_options.run_folder_name(
        args.model_name_or_path.replace("/", "_") if args.model_name_or_path else None, args.train_file,
        "lora" if args.lora else None))  # fmt: skip
    if not args.model_name_or_path:
        parser.error(f"--model-name-or-path is required: a {DECODERS} checkpoint (a Hub id or a folder) to fine-tune")
    recipe_options.check_causal_metric_context(parser, args)
    pretrained_model.check_pretrained(parser, args, pretrained_model.CAUSAL_LM, new_model_flags=())
    args.row_format = row_format(args.train_file)
    if args.validation_file and row_format(args.validation_file) != args.row_format:
        parser.error(f"--validation-file {args.validation_file} holds {row_format(args.validation_file)} rows, "
                     f"--train-file {args.row_format} rows; write both in one format")  # fmt: skip
    if args.assistant_only_loss and args.row_format != "messages":
        parser.error(f"--assistant-only-loss applies to messages rows; {args.train_file} holds prompt-completion rows, "
                     "trained on the completion only already: leave the flag out")  # fmt: skip
    given = [name for name in LORA_FLAGS if getattr(args, name) is not None]
    if given and not args.lora:
        parser.error(f"--{given[0].replace('_', '-')} applies to LoRA; add --lora, or leave it out")
    args.lora_rank, args.lora_alpha = args.lora_rank or 16, args.lora_alpha or 32
    args.lora_dropout = args.lora_dropout or 0.0
    pretrained_model.cap_at_checkpoint_context(parser, args, "max_length")
    return args


def chat_datasets(args):
    """(train, validation) conversations: the files, or --validation-fraction of --train-file held out (seeded)."""
    import datasets

    columns = list(FORMATS[args.row_format])
    train = datasets.load_dataset("json", data_files=args.train_file, split="train").select_columns(columns)
    if args.validation_file:
        validation = datasets.load_dataset("json", data_files=args.validation_file, split="train")
        validation = validation.select_columns(columns)
    else:
        if len(train) < 2:
            raise ValueError(f"--train-file {args.train_file} holds 1 conversation; hold-out needs 2 or more, or give "
                             "--validation-file")  # fmt: skip
        held_out = max(1, round(args.validation_fraction * len(train)))
        split = train.train_test_split(test_size=held_out, seed=args.seed)
        train, validation = split["train"], split["test"]
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    validation = validation.select(range(min(args.max_eval_samples, len(validation))))
    return train, validation


def lora_config(args, model):
    """TRL's `peft_config`: LoRA on the family's projections; the cross-head modules (DAMCHA's metric generator, a
    baseline's mixing) trained in full and saved with the adapter (`modules_to_save`)."""
    from peft import LoraConfig

    family = args.pretrained_family
    variant = model.config.cross_head_variant
    cross_head = {"damcha": ["cross_head_metric"], "none": []}.get(variant, ["cross_head_mixing"])
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(family.lora_target_modules),
        modules_to_save=cross_head,
        fan_in_fan_out=family.lora_fan_in_fan_out,
        bias="none",
    )


def build_trainer(args):
    """(SFTTrainer, tokenizer, train, validation) for the parsed arguments: the checkpoint's tokenizer (its chat
    template), the conversations, the converted model and, with --lora, TRL's `peft_config`."""
    from trl import SFTConfig, SFTTrainer

    from damcha_hf.data import check_tokenizer_matches_model

    tokenizer = pretrained_model.load_pretrained_tokenizer(args, max_length=args.max_length)
    if not tokenizer.chat_template:
        raise ValueError(f"--model-name-or-path {args.model_name_or_path}: its tokenizer has no chat template to render "
                         "the conversations with; start from an instruct/chat checkpoint, or set tokenizer.chat_template "
                         "and save the tokenizer into the folder")  # fmt: skip
    train, validation = chat_datasets(args)
    model = pretrained_model.load_pretrained_model(args)
    check_tokenizer_matches_model(tokenizer, model.config)
    peft_config = lora_config(args, model) if args.lora else None
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {len(train)} training and {len(validation)} "
          f"validation conversations" + (f"; LoRA rank {args.lora_rank}" if args.lora else ""), flush=True)  # fmt: skip
    sft_args = recipe_options.training_arguments(
        args,
        arguments_class=SFTConfig,
        max_length=args.max_length,
        packing=args.packing,
        assistant_only_loss=args.assistant_only_loss,
        completion_only_loss=args.row_format == "prompt-completion",
    )
    trainer = SFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=train,
        eval_dataset=validation,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    return trainer, tokenizer, train, validation


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import set_seed

    set_seed(args.seed)
    trainer, tokenizer, train, validation = build_trainer(args)
    train_result = run_folder.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss,
                   eval_conversations=len(validation))  # fmt: skip
    run_folder.print_evaluation(metrics)

    trained = trainer.model
    if args.lora:
        adapter = os.path.join(args.output_dir, "adapter")
        run.writing(adapter)  # written in place by PEFT: named in the run record first
        trained.save_pretrained(adapter, save_embedding_layers=False)
        tokenizer.save_pretrained(adapter)
        run.wrote(adapter)
        trained = trained.merge_and_unload()
    final = os.path.join(args.output_dir, "final")
    loss_on = {"prompt-completion": "the completions", "messages": "the assistant turns"}[args.row_format]
    loss_on = loss_on if args.assistant_only_loss or args.row_format == "prompt-completion" else "every token"
    run_folder.save_final_model(
        trained,
        final,
        tokenizer_or_processor=tokenizer,
        log_history=trainer.state.log_history,
        datasets=run_folder.card_datasets(args.train_file),
        base_model=pretrained_model.card_base_model(args),
        notes=[f"Supervised fine-tuning with TRL's SFTTrainer on {len(train)} conversations (loss on {loss_on}"
               + (", packed" if args.packing else "") + (f", LoRA rank {args.lora_rank} merged" if args.lora else "")
               + f"); validation figures on {len(validation)} held-out conversations."],
    )  # fmt: skip
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
