#!/usr/bin/env python
"""Train a DAMCHA BART encoder-decoder with the transformers `Seq2SeqTrainer`, reporting loss, BLEU, chrF and ROUGE.

    python recipes/train_bart.py                                   # stdlib signatures -> first docstring line
    python recipes/train_bart.py --max-steps 5                     # a quick check, under a minute
    python recipes/train_bart.py --metric-context query --encoder-metric-context sequence
    python recipes/train_bart.py --model-type bart                 # the multi-head-attention baseline, same settings
    python recipes/train_bart.py --data pairs.jsonl                # {"source": ..., "target": ...} per line
    python recipes/train_bart.py --model-name-or-path facebook/bart-base --data pairs.jsonl   # fine-tune a pretrained BART
    python recipes/train_bart.py --train-file news.csv --text-column article --summary-column headline
    python recipes/train_bart.py --dataset-name path/to/saved_dataset --validation-split test

Data, as transformers' run_summarization.py takes it: `--dataset-name` (a Hub id, a local dataset folder or a
`save_to_disk` folder; `--dataset-config-name`, `--train-split`, `--validation-split`) or `--train-file` /
`--validation-file` (json/jsonl, csv or parquet, by extension), the input text in `--text-column` and the text to
generate in `--summary-column`; without a validation split or file, `--validation-split-percentage` of the rows is
held out. The shipped pairs are the `--data` presets.

The default task maps each documented function of the Python standard library to the first line of its docstring
(`Class.method(self, x=1) -> str` => "Return the ..."): short text from a structured input, like CommonGen, on data
every machine has. Validation pairs come from files training never sees. Generated text is scored with BLEU and chrF
(sacrebleu) and ROUGE (rouge-score), through the `evaluate` modules shipped in `damcha_hf.metrics`; the loss is the
mean cross-entropy per target token. The model, its tokenizer and a model card are saved to `<output-dir>/final`.

`--model-name-or-path` (a Hub id or a local folder) starts from a pretrained BART: a stock checkpoint is converted to
DAMCHA with every weight kept (its outputs unchanged before the first step), a DAMCHA checkpoint is fine-tuned as it
is, and its own tokenizer is used. BLEU, chrF and ROUGE need the `seq2seq` extra (`pip install -e ".[seq2seq]"`),
checked before any work.

On `--resume`, the checkpoint's model settings win: a model flag left out takes the checkpoint's value, one given with
a different value is refused (naming every such flag).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrained_model
import recipe_options  # standard library only: torch and transformers are imported after the arguments are parsed
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources
from damcha_hf.modeling import damcha_config as options
from damcha_hf.optional_packages import check_extras

MODEL_TYPES = ("damcha_bart", "bart")
# Flags of a new model and the config fields they set: checked against the checkpoint on --resume.
BART_MODEL_FLAGS = {"d_model": "d_model", "layers": "encoder_layers", "heads": "encoder_attention_heads",
                    "ffn_dim": "encoder_ffn_dim", "encoder_metric_context": "encoder_metric_context",
                    "cross_attention_metric": "cross_attention_metric",
                    **{field: field for field in recipe_options.METRIC_FIELDS}}  # fmt: skip


ROW_EXAMPLE = '{"source": "...", "target": "..."}'
# The fewest documents the train/validation split takes (`damcha_hf.data.validation_document_count`): one held out
# for validation, one left for training.
MIN_DOCUMENTS = 2


def seq2seq_data(text: str) -> str:
    """--data: 'stdlib' or a JSON-lines file of pairs, checked while parsing (`check_pairs_file`)."""
    if text == "stdlib":
        return text
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist; use 'stdlib' or a JSON-lines file of {ROW_EXAMPLE} rows"
        )
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a file; use 'stdlib' or a JSON-lines file of {ROW_EXAMPLE} rows"
        )
    check_pairs_file(text)
    return text


def json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def check_pairs_file(path: str) -> None:
    """Every line of a JSON-lines pairs file is an object with `source` and `target` text and, optionally, a
    `document` (a string or an integer; in every row or none) that groups rows; the rows make at least MIN_DOCUMENTS
    documents. The first fault is refused (`ArgumentTypeError`) in one line naming the file, the line, the field and
    the fix. Blank lines are skipped, as the reader skips them."""
    rows, documents, with_document = 0, set(), None
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise argparse.ArgumentTypeError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(
                    f"{where}: not JSON ({error.msg}, column {error.colno}); write one JSON object per line, e.g. "
                    f"{ROW_EXAMPLE}"
                ) from None
            if not isinstance(row, dict):
                raise argparse.ArgumentTypeError(
                    f"{where}: {json_type(row)}, not a JSON object; write one object per line, e.g. {ROW_EXAMPLE}"
                )
            for field in ("source", "target"):
                if field not in row:
                    raise argparse.ArgumentTypeError(
                        f'{where}: no "{field}" field; every row needs "source" and "target" text, e.g. {ROW_EXAMPLE}'
                    )
                if not isinstance(row[field], str):
                    shown = "" if row[field] is None else f" ({json.dumps(row[field])[:40]})"
                    raise argparse.ArgumentTypeError(
                        f'{where}: "{field}" is {json_type(row[field])}{shown}, not a string; write it as text, e.g. '
                        f'"{field}": "..."'
                    )
                if not row[field].strip():
                    raise argparse.ArgumentTypeError(
                        f'{where}: "{field}" is empty; give the pair some text, or remove the row'
                    )
            if with_document is None:
                with_document = "document" in row
            if ("document" in row) != with_document:
                raise argparse.ArgumentTypeError(
                    f'{where}: {"a" if "document" in row else "no"} "document" field, unlike the first row; give '
                    'every row a "document" (rows of one document stay on one side of the split), or none'
                )
            document = row.get("document", number)  # without the field each row is its own document
            if isinstance(document, bool) or not isinstance(document, str | int):
                raise argparse.ArgumentTypeError(
                    f'{where}: "document" is {json_type(document)}; give a string or an integer naming the row\'s '
                    "document"
                )
            rows += 1
            documents.add(document)
    if len(documents) < MIN_DOCUMENTS:
        pairs = f"{rows} pair{'s' * (rows != 1)}"
        if with_document:
            found = f"{pairs} in {len(documents)} document{'s' * (len(documents) != 1)}"
            needed = f'{MIN_DOCUMENTS} documents (distinct "document" values)'
        else:
            found, needed = pairs, f"{MIN_DOCUMENTS} rows (each row is its own document)"
        raise argparse.ArgumentTypeError(
            f"{path} holds {found}; the train/validation split needs at least {needed}: 1 held out for validation, "
            "the rest for training"
        )


PAIR_COLUMN_FLAGS = {"--text-column": "text_column", "--summary-column": "summary_column"}


def data_label(args: argparse.Namespace) -> str:
    """What the data are called (run folder, model card): --dataset-name, --train-file or --data."""
    return args.dataset_name or args.train_file or args.data


def load_pairs(args, max_train_pairs: int | None):
    """`train` and `validation` of `source` / `target` pairs: --dataset-name / --train-file through `datasets` (the
    --text-column and --summary-column), or the --data preset (`damcha_hf.data.load_seq2seq_pairs`)."""
    from damcha_hf.data import load_dataset_splits, load_seq2seq_pairs

    if not data_sources.uses_datasets_flags(args):
        return load_seq2seq_pairs(args.data, validation_fraction=args.validation_fraction, seed=args.seed,
                                  max_train_pairs=max_train_pairs)  # fmt: skip
    pairs = load_dataset_splits(
        dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
        validation_file=args.validation_file, train_split=args.train_split, validation_split=args.validation_split,
        validation_fraction=args.validation_fraction, share_flag=data_sources.held_out_share_flag(args),
        columns={"--text-column": args.text_column, "--summary-column": args.summary_column},
    )  # fmt: skip
    if args.text_column == args.summary_column:
        raise ValueError(f"--text-column and --summary-column are both {args.text_column!r}; name two columns")
    pairs = pairs.select_columns([args.text_column, args.summary_column])
    renames = {args.text_column: "source", args.summary_column: "target"}
    pairs = pairs.rename_columns({old: new for old, new in renames.items() if old != new})
    flags = {"source": ("--text-column", args.text_column), "target": ("--summary-column", args.summary_column)}
    for name, rows in pairs.items():
        for column, (flag, given) in flags.items():
            if getattr(rows.features[column], "dtype", None) not in ("string", "large_string"):
                raise ValueError(f"{flag} {given}: the {name} split's column holds {rows.features[column]}, not "
                                 "text; name a column of text")  # fmt: skip
    pairs = pairs.filter(lambda row: bool(row["source"] and row["target"]))  # rows without text teach nothing
    if max_train_pairs is not None:
        pairs["train"] = pairs["train"].select(range(min(max_train_pairs, len(pairs["train"]))))
    return pairs


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    group = parser.add_argument_group("data")
    group.add_argument("--data", default="stdlib", type=seq2seq_data,
                       help="'stdlib' (default: signature -> first docstring line) or a JSON-lines file of "
                       f"{ROW_EXAMPLE} rows, with an optional \"document\" (rows of one document stay on one side of "
                       "the split)")  # fmt: skip
    group.add_argument("--validation-fraction", type=checks.probability, default=0.05,
                       help="share of the documents (files) held out for validation")  # fmt: skip
    data_sources.add_dataset_arguments(group, task_columns={
        "--text-column": ("source", "the column of --dataset-name / --train-file holding the input text"),
        "--summary-column": ("target", "the column holding the text to generate from it"),
    })  # fmt: skip
    group.add_argument("--max-source-length", type=checks.positive_int, default=64, help="tokens")
    group.add_argument("--max-target-length", type=checks.positive_int, default=32, help="tokens")
    group.add_argument("--bpe-vocab-size", type=checks.positive_int, default=2048,
                       help="size of the byte-level BPE tokenizer trained on the training pairs")  # fmt: skip
    pretrained_model.add_pretrained_argument(parser, "BART")
    group = parser.add_argument_group("model (new models)")
    group.add_argument("--model-type", choices=MODEL_TYPES, default="damcha_bart",
                       help="damcha_bart, or bart: stock BART, the multi-head-attention baseline")  # fmt: skip
    group.add_argument("--d-model", type=checks.positive_int, default=128)
    group.add_argument("--layers", type=checks.positive_int, default=2, help="encoder and decoder layers each")
    group.add_argument("--heads", type=checks.positive_int, default=4, help="must divide --d-model")
    group.add_argument("--ffn-dim", type=checks.positive_int, default=512)
    recipe_options.add_metric_arguments(parser)
    group = parser.add_argument_group("DAMCHA in the encoder-decoder (defaults: the config's)")
    group.add_argument("--encoder-metric-context", choices=options.METRIC_CONTEXTS,
                       help="the encoder's context (default: --metric-context; 'sequence' is allowed here)")  # fmt: skip
    group.add_argument("--cross-attention-metric", choices=("decoder", "own", "none"),
                       help="the cross-attention's generator: the decoder's, its own, or none (plain attention)")  # fmt: skip
    group = parser.add_argument_group("generation (validation)")
    group.add_argument("--num-beams", type=checks.positive_int, default=1)
    recipe_options.add_training_arguments(parser, output_dir="runs/{settings}", batch_size=32, learning_rate=1e-3,
                                          max_steps=3000, output_dir_example="runs/damcha_bart-stdlib")  # fmt: skip
    # The generation metrics' packages, checked once the arguments are known (so --help always answers) and before the
    # run folder is taken or any data read.
    parser.parse_known_args(argv)
    check_extras(parser, "recipes/train_bart.py", "seq2seq")
    args = recipe_options.parse_checked(parser, argv, run_name=run_name)
    data_sources.check_dataset_arguments(parser, args, columns=PAIR_COLUMN_FLAGS)
    recipe_options.check_causal_metric_context(parser, args)  # the decoder is causal; the encoder has its own flag
    pretrained_model.check_pretrained(parser, args, pretrained_model.SEQ2SEQ, new_model_flags=NEW_MODEL_FLAGS)
    if args.model_name_or_path:
        return args
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    recipe_options.check_variant_flags(
        parser,
        args,
        model_type=args.model_type,
        sizes={"hidden_size": args.d_model, "num_attention_heads": args.heads},
        size_flags={"hidden_size": "--d-model", "num_attention_heads": "--heads"},
        extra_flags=("encoder_metric_context", "cross_attention_metric"),
    )
    return args


# The flags that shape a new model (and its tokenizer): a pretrained checkpoint brings its own.
NEW_MODEL_FLAGS = ("model_type", "d_model", "layers", "heads", "ffn_dim", "bpe_vocab_size")


def run_name(args) -> str:
    """The default run folder: the model type (or the pretrained checkpoint's name) and the data."""
    start = f"damcha-{args.model_name_or_path.replace('/', '_')}" if args.model_name_or_path else args.model_type
    return recipe_options.run_folder_name(start, data_label(args))


def bart_config(args, tokenizer):
    from transformers import BartConfig

    from damcha_hf import DamchaBartConfig

    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)  # begins, ends and pads every sequence
    shape = {
        "vocab_size": len(tokenizer),
        "d_model": args.d_model,
        "encoder_layers": args.layers,
        "decoder_layers": args.layers,
        "encoder_attention_heads": args.heads,
        "decoder_attention_heads": args.heads,
        "encoder_ffn_dim": args.ffn_dim,
        "decoder_ffn_dim": args.ffn_dim,
        "max_position_embeddings": max(args.max_source_length, args.max_target_length),
        "dropout": 0.1,
        "pad_token_id": special,
        "bos_token_id": special,
        "eos_token_id": special,
        "decoder_start_token_id": special,
        "forced_eos_token_id": None,
    }
    if args.model_type == "bart":
        return BartConfig(**shape)
    extra = {flag: getattr(args, flag) for flag in ("encoder_metric_context", "cross_attention_metric")
             if getattr(args, flag) is not None}  # fmt: skip
    return DamchaBartConfig(**shape, **recipe_options.metric_options(args), **extra)


def tokenized_pairs(args, tokenizer, pairs):
    # A pretrained tokenizer (BART's) frames each text with its special tokens itself; the recipe's own BPE does not,
    # so it gets the end-of-sequence token appended here.
    framed = tokenizer("a")["input_ids"][-1:] == [tokenizer.eos_token_id]
    if framed:
        return pairs.map(
            lambda batch: {
                **tokenizer(batch["source"], max_length=args.max_source_length, truncation=True),
                "labels": tokenizer(text_target=batch["target"], max_length=args.max_target_length, truncation=True)[
                    "input_ids"
                ],
            },
            batched=True,
            remove_columns=pairs.column_names,
        )

    def encode(batch):
        inputs = tokenizer(batch["source"], max_length=args.max_source_length - 1, truncation=True)
        targets = tokenizer(batch["target"], max_length=args.max_target_length - 1, truncation=True)
        end = [tokenizer.eos_token_id]
        return {"input_ids": [ids + end for ids in inputs["input_ids"]],
                "attention_mask": [mask + [1] for mask in inputs["attention_mask"]],
                "labels": [ids + end for ids in targets["input_ids"]]}  # fmt: skip

    return pairs.map(encode, batched=True, remove_columns=pairs.column_names)


def generation_metrics(tokenizer):
    """`compute_metrics` of generated ids: BLEU and chrF (sacrebleu), ROUGE (rouge-score), shipped evaluate modules."""
    import numpy as np

    from damcha_hf.metrics import load_metric

    scorers = load_metric("sacrebleu_scores"), load_metric("rouge")

    def compute(prediction):
        predictions, labels = prediction.predictions, prediction.label_ids
        predictions = np.where(predictions < 0, tokenizer.pad_token_id, predictions)
        labels = np.where(labels < 0, tokenizer.pad_token_id, labels)
        texts = [text.strip() for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]
        references = [text.strip() for text in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        scores = {}
        for scorer in scorers:
            scores.update(scorer.compute(predictions=texts, references=references))
        return scores

    return compute


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    if resume:
        run_folder.check_resume_settings(args, resume, BART_MODEL_FLAGS, run_folder.saved_model_config(resume))
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, Seq2SeqTrainer, set_seed

    from damcha_hf.data import check_tokenizer_matches_model, train_bpe_tokenizer

    set_seed(args.seed)
    needed = args.max_steps * args.batch_size * args.gradient_accumulation_steps
    quick = args.max_steps < recipe_options.QUICK_RUN_STEPS
    print(f"reading {data_label(args)} pairs...", flush=True)
    pairs = load_pairs(args, needed if quick else None)
    documents = len(set(pairs["validation"]["document"])) if "document" in pairs["validation"].column_names else None
    validation_pairs = (
        pairs["validation"].shuffle(seed=args.seed).select(range(min(args.max_eval_samples, len(pairs["validation"]))))
    )
    covers = f" from {documents} held-out files" if documents else ""
    print(f"{len(pairs['train'])} training pairs; validation: {len(validation_pairs)} pairs{covers}", flush=True)
    if resume and os.path.isfile(os.path.join(resume, "tokenizer.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resume)  # the one the checkpoint was trained with
    elif args.model_name_or_path:
        tokenizer = pretrained_model.load_pretrained_tokenizer(
            args, max_length=max(args.max_source_length, args.max_target_length)
        )
    else:
        texts = list(pairs["train"]["source"]) + list(pairs["train"]["target"])
        tokenizer = train_bpe_tokenizer(texts, args.bpe_vocab_size,
                                        model_max_length=max(args.max_source_length, args.max_target_length))  # fmt: skip
    train = tokenized_pairs(args, tokenizer, pairs["train"])
    validation = tokenized_pairs(args, tokenizer, validation_pairs)
    if args.model_name_or_path:
        model = pretrained_model.load_pretrained_model(args)
        check_tokenizer_matches_model(tokenizer, model.config)
    else:
        model = AutoModelForSeq2SeqLM.from_config(bart_config(args, tokenizer), attn_implementation=args.attn)
    model.generation_config.max_length = args.max_target_length
    model.generation_config.num_beams = args.num_beams
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters", flush=True)

    training_args = recipe_options.training_arguments(args, seq2seq=True, predict_with_generate=True,
                                                      generation_max_length=args.max_target_length,
                                                      generation_num_beams=args.num_beams)  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=generation_metrics(tokenizer),
    )
    train_result = run_folder.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss,
                   eval_pairs=len(validation_pairs), eval_documents=documents)  # fmt: skip
    run_folder.print_evaluation(metrics)

    sample = validation_pairs[0]
    inputs = tokenizer(sample["source"], return_tensors="pt").to(trainer.model.device)
    generated = trainer.model.generate(**inputs, max_length=args.max_target_length, num_beams=args.num_beams)
    print(f"sample: {sample['source']}\n  generated: {tokenizer.decode(generated[0], skip_special_tokens=True)}\n"
          f"  reference: {sample['target']}")  # fmt: skip

    final = os.path.join(args.output_dir, "final")
    covered = f"{len(validation_pairs)} pairs{covers}"
    run_folder.save_final_model(
        trainer.model,
        final,
        tokenizer_or_processor=tokenizer,
        log_history=trainer.state.log_history,
        datasets=run_folder.card_datasets(data_label(args)),
        base_model=pretrained_model.card_base_model(args),
        notes=[f"Validation figures: {covered}, none of them seen in training; BLEU and chrF by sacrebleu, ROUGE F1 "
               "by rouge-score, of greedy generations" + (f" ({args.num_beams} beams)" if args.num_beams > 1 else "")],
    )  # fmt: skip
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
