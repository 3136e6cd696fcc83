#!/usr/bin/env python
"""Pretrain a DAMCHA GPT-2 with the transformers `Trainer` on local text, reporting bits per byte.

    python recipes/train_gpt2.py --data corpus.txt                                # byte-level, runs/damcha_gpt2-corpus-byte
    python recipes/train_gpt2.py --data stdlib --tokenizer bpe --max-steps 2000   # BPE trained on the corpus
    python recipes/train_gpt2.py --data gcide --metric-context query --attn eager
    python recipes/train_gpt2.py --output-dir runs/gpt2 --resume                  # continue the latest checkpoint
    python recipes/train_gpt2.py --model-type damcha_llama --n-head 8 --n-kv-head 2   # Llama, grouped-query

On `--resume`, the checkpoint's model settings (`--model-type` included) win: a model flag left out takes the
checkpoint's value, one given with a different value is refused (naming every such flag).

Data (`--data`): a text file, a folder of .txt files, a glob, `stdlib` (the Python standard library's sources, on
every machine) or `gcide`. The model, its tokenizer and a model card (`damcha_hf.hub`) with a
loss curve are saved to `<output-dir>/final`; evaluation results go to `<output-dir>/eval_results.json`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import recipe_options  # standard library only: torch and transformers are imported after the arguments are parsed
import run_folder
import text_data

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import checkpoint_checks


def parse_args(argv=None) -> argparse.Namespace:
    parser = checks.ArgumentParser(description=__doc__, formatter_class=checks.HelpFormatter)
    text_data.add_text_data_arguments(parser)
    text_data.add_gpt2_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this checkpoint folder instead of a new model")
    recipe_options.add_metric_arguments(parser)
    recipe_options.add_training_arguments(parser, output_dir="runs/{settings}", batch_size=16, learning_rate=2e-3,
                                          max_steps=1000)  # fmt: skip
    args = recipe_options.parse_checked(parser, argv, run_name=text_data.language_model_run_name)
    recipe_options.check_causal_metric_context(parser, args)
    if not args.init_from:
        text_data.check_new_language_model_sizes(parser, args)
    if args.init_from and not os.path.isdir(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such checkpoint folder")
    if args.init_from:  # a damaged file is named now, before any data is read
        checks.check_output(parser, checkpoint_checks.check_checkpoint_files, args.init_from)
    return args


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    from damcha_hf.data import check_tokenizer_matches_model

    if args.init_from:
        with checkpoint_checks.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            model = AutoModelForCausalLM.from_pretrained(args.init_from, attn_implementation=args.attn)
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
    datasets = run_folder.card_datasets(args.data)  # what the card will say, settled before training
    recipe_options.check_push(args)
    run = run_folder.start_run(args, resume)

    from transformers import DataCollatorForLanguageModeling, Trainer, set_seed

    from damcha_hf.metrics import causal_lm_compute_metrics, causal_lm_token_nll

    set_seed(args.seed)
    if resume and os.path.isfile(os.path.join(resume, "tokenizer.json")):
        text_data.check_resume_tokenizer(args, resume)
        args.tokenizer = resume  # the Trainer saved the tokenizer with the checkpoint: a retrained BPE could differ
    corpus = text_data.load_language_model_corpus(args)
    tokenizer = text_data.build_tokenizer(args, corpus)
    train, validation = text_data.language_model_data(args, tokenizer, corpus)
    model = build_model(args, tokenizer)
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {len(train)} training blocks of "
          f"{args.block_size} tokens, {len(validation)} validation blocks")  # fmt: skip

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
        notes=[f"Validation figures: {args.validation_note}, none of them seen in training."],
    )
    run_folder.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    recipe_options.run_recipe(main)
