#!/usr/bin/env python
"""Pretrain a DAMCHA GPT-2 with the transformers `Trainer` on local text, reporting bits per byte.

    python recipes/train_gpt2.py --data corpus.txt                                # byte-level, runs/damcha_gpt2-corpus-byte
    python recipes/train_gpt2.py --data stdlib --tokenizer bpe --max-steps 2000   # BPE trained on the corpus
    python recipes/train_gpt2.py --data gcide --metric-context query --attn eager
    python recipes/train_gpt2.py --output-dir runs/gpt2 --resume                  # continue the latest checkpoint
    python recipes/train_gpt2.py --model-type damcha_llama --n-head 8 --n-kv-head 2   # Llama, grouped-query
    python recipes/train_gpt2.py --model-name-or-path Qwen/Qwen2.5-0.5B --data corpus.txt  # fine-tune a pretrained model

`--model-name-or-path` (a Hub id or a local folder) starts from a pretrained GPT-2,
Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2: a stock checkpoint is converted to DAMCHA with every weight kept (its
outputs unchanged before the first step), a DAMCHA checkpoint is fine-tuned as it is, and its own tokenizer is used.

On `--resume`, the checkpoint's model settings (`--model-type` included) win: a model flag left out takes the
checkpoint's value, one given with a different value is refused (naming every such flag).

Data, as transformers' run_clm.py takes it: `--dataset-name` (a Hub id, a local dataset folder or a `save_to_disk`
folder; `--dataset-config-name`, `--train-split`, `--validation-split`) or `--train-file` / `--validation-file` (txt,
json/jsonl, csv or parquet, by extension), the text in `--text-column-name`; without a validation split or file,
`--validation-split-percentage` of the rows is held out. `--streaming` reads the data as a stream, tokenized and packed
on the fly (a corpus larger than memory). The shipped sources are presets of the same path (`--data`): a text file, a
folder of .txt files, a glob, `stdlib` (the Python standard library's sources, on every machine; the default) or
`gcide`.

    python recipes/train_gpt2.py --train-file corpus.parquet --text-column-name content --max-steps 500
    python recipes/train_gpt2.py --dataset-name path/to/saved_dataset --streaming --max-steps 500

The model, its tokenizer and a model card (`damcha_hf.hub`) with a loss curve are saved to `<output-dir>/final`;
evaluation results go to `<output-dir>/eval_results.json`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrained_model
import recipe_options  # standard library only: torch and transformers are imported after the arguments are parsed
import run_folder
import text_data

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import checkpoint_checks


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    text_data.add_text_data_arguments(parser)
    text_data.add_gpt2_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this checkpoint folder instead of a new model (its size; the "
                        "--cross-head-variant and variant flags given apply to an MHA checkpoint, cross_head_variant "
                        "none, each variant starting as its function, and are refused on another one)")  # fmt: skip
    pretrained_model.add_pretrained_argument(parser, "GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2")
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/{settings}", batch_size=16, learning_rate=2e-3,
                                          max_steps=1000)  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=run_name)
    text_data.check_text_data_arguments(parser, args)
    recipe_options.check_causal_metric_context(parser, args)
    if not args.model_name_or_path and not args.init_from:
        text_data.check_new_language_model_sizes(parser, args)
    if args.init_from and not os.path.isdir(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such checkpoint folder")
    if args.init_from:  # a damaged file is named now, before any data is read
        checks.check_output(parser, checkpoint_checks.check_checkpoint_files, args.init_from)
    pretrained_model.check_pretrained(parser, args, pretrained_model.CAUSAL_LM, new_model_flags=NEW_MODEL_FLAGS)
    if (
        args.model_name_or_path
        and "tokenizer" not in args.explicit
        and pretrained_model.has_tokenizer(args.model_name_or_path)
    ):
        args.tokenizer = args.model_name_or_path  # its own tokenizer (a folder without one: --tokenizer's default)
    if args.model_name_or_path:
        pretrained_model.cap_at_checkpoint_context(parser, args, "block_size")
    if not args.model_name_or_path:  # a pretrained checkpoint's are checked with it (`check_pretrained`)
        recipe_options.check_language_model_variant_flags(parser, args)
    return args


# The flags that shape a new model: a pretrained checkpoint brings its own shape.
NEW_MODEL_FLAGS = ("model_type", "n_layer", "n_embd", "n_head", "n_kv_head", "dropout")


def run_name(args) -> str:
    """The default run folder: a new model's settings, or the pretrained checkpoint's name and the variant flags."""
    if not args.model_name_or_path:
        return text_data.language_model_run_name(args)
    model = args.model_name_or_path.replace("/", "_")
    return recipe_options.run_folder_name(
        "damcha", model, args.cross_head_variant, args.metric_context, text_data.data_label(args)
    )


def build_tokenizer(args, corpus, resumed: bool):
    """--tokenizer's tokenizer; the pretrained checkpoint's own when it is used (not on resume, where the run's saved
    one is)."""
    if args.model_name_or_path and args.tokenizer == args.model_name_or_path and not resumed:
        return pretrained_model.load_pretrained_tokenizer(args, max_length=args.block_size)
    return text_data.build_tokenizer(args, corpus)


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    from damcha_hf.data import check_tokenizer_matches_model

    if args.model_name_or_path:
        model = pretrained_model.load_pretrained_model(args)
    elif args.init_from:
        with checkpoint_checks.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            model = AutoModelForCausalLM.from_pretrained(args.init_from, attn_implementation=args.attn,
                                                         **recipe_options.metric_options(args))  # fmt: skip
    else:
        model = AutoModelForCausalLM.from_config(text_data.language_model_config(args, len(tokenizer), tokenizer))
    check_tokenizer_matches_model(tokenizer, model.config)
    text_data.use_causal_lm_loss(model)
    if model.config.max_position_embeddings < args.block_size:
        raise ValueError(
            f"--block-size {args.block_size} exceeds the model's context length (`max_position_embeddings`, "
            f"{model.config.max_position_embeddings}); use a smaller --block-size."
        )
    return model


@run_folder.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = run_folder.trainer_resume(args)
    text_data.check_language_model_resume(args, resume)
    datasets = run_folder.card_datasets(text_data.data_label(args))  # what the card will say, settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import DataCollatorForLanguageModeling, Trainer, set_seed

    from damcha_hf.metrics import causal_lm_compute_metrics, causal_lm_token_nll

    set_seed(args.seed)
    resumed_tokenizer = bool(resume and os.path.isfile(os.path.join(resume, "tokenizer.json")))
    if resumed_tokenizer:
        text_data.check_resume_tokenizer(args, resume)
        args.tokenizer = resume  # the Trainer saved the tokenizer with the checkpoint: a retrained BPE could differ
    corpus = text_data.load_language_model_corpus(args)
    tokenizer = build_tokenizer(args, corpus, resumed_tokenizer)
    if args.streaming:
        train, validation = text_data.streaming_language_model_data(args, tokenizer, corpus)
    else:
        train, validation = text_data.language_model_data(args, tokenizer, corpus)
    model = build_model(args, tokenizer)
    training = "training blocks streamed" if args.streaming else f"{len(train)} training blocks"
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {training} of {args.block_size} tokens, "
          f"{len(validation)} validation blocks")  # fmt: skip

    trainer = Trainer(
        model=model,
        args=recipe_options.training_arguments(args),
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        compute_metrics=causal_lm_compute_metrics(tokenizer),
        preprocess_logits_for_metrics=causal_lm_token_nll,
    )
    train_result = run_folder.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss,
                   eval_documents=args.validation_documents)  # fmt: skip
    run_folder.print_evaluation(metrics)

    final = os.path.join(args.output_dir, "final")
    run_folder.save_final_model(
        trainer.model,
        final,
        tokenizer_or_processor=tokenizer,
        log_history=trainer.state.log_history,
        datasets=datasets,
        base_model=pretrained_model.card_base_model(args),
        notes=[f"Validation figures: {args.validation_note}, none of them seen in training."],
    )
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
