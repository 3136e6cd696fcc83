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

import common  # standard library only: torch and transformers are imported after the arguments are parsed


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.checks.ArgumentParser(description=__doc__, formatter_class=common.checks.HelpFormatter)
    common.add_text_data_arguments(parser)
    common.add_gpt2_size_arguments(parser)
    parser.add_argument("--init-from", help="start from this checkpoint folder instead of a new model")
    common.add_metric_arguments(parser)
    common.add_training_arguments(parser, output_dir="runs/{settings}", batch_size=16, learning_rate=2e-3,
                                  max_steps=1000)  # fmt: skip
    args = common.parse_checked(parser, argv, run_name=common.language_model_run_name)
    common.check_causal_metric_context(parser, args)
    if not args.init_from:
        common.check_new_language_model_sizes(parser, args)
    if args.init_from and not os.path.isdir(args.init_from):
        parser.error(f"--init-from {args.init_from}: no such checkpoint folder")
    if args.init_from:  # a damaged file is named now, before any data is read
        common.checks.check_output(parser, common.safe_files.check_checkpoint_files, args.init_from)
    return args


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    from damcha_hf.data import check_tokenizer_matches_model

    if args.init_from:
        with common.safe_files.loading_checkpoint(args.init_from, "the --init-from checkpoint"):
            model = AutoModelForCausalLM.from_pretrained(args.init_from, attn_implementation=args.attn)
    else:
        model = AutoModelForCausalLM.from_config(common.gpt2_config(args, len(tokenizer), tokenizer))
    check_tokenizer_matches_model(tokenizer, model.config)
    common.use_causal_lm_loss(model)
    if model.config.max_position_embeddings < args.block_size:
        raise ValueError(
            f"--block-size {args.block_size} exceeds the model's context length (`max_position_embeddings`, "
            f"{model.config.max_position_embeddings}); use a smaller --block-size."
        )
    return model


@common.holding_run_folder
def main(argv=None) -> dict:
    args = parse_args(argv)
    resume, load_state = common.trainer_resume(args)
    common.check_language_model_resume(args, resume)
    datasets = common.card_datasets(args.data)  # what the card will say, settled before training
    common.check_push(args)
    run = common.start_run(args, resume)

    from transformers import DataCollatorForLanguageModeling, Trainer, set_seed

    from damcha_hf.metrics import causal_lm_compute_metrics, causal_lm_token_nll

    set_seed(args.seed)
    if resume and os.path.isfile(os.path.join(resume, "tokenizer.json")):
        common.check_resume_tokenizer(args, resume)
        args.tokenizer = resume  # the Trainer saved the tokenizer with the checkpoint: a retrained BPE could differ
    corpus = common.load_language_model_corpus(args)
    tokenizer = common.build_tokenizer(args, corpus)
    train, validation = common.language_model_data(args, tokenizer, corpus)
    model = build_model(args, tokenizer)
    print(f"{type(model).__name__}: {model.num_parameters():,} parameters; {len(train)} training blocks of "
          f"{args.block_size} tokens, {len(validation)} validation blocks")  # fmt: skip

    trainer = Trainer(
        model=model,
        args=common.training_arguments(args),
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        compute_metrics=causal_lm_compute_metrics(tokenizer),
        preprocess_logits_for_metrics=causal_lm_token_nll,
    )
    train_result = common.train(trainer, run, load_state)
    metrics = trainer.evaluate()
    metrics.update(global_step=trainer.state.global_step, resumed_from=resume, train_loss=train_result.training_loss,
                   eval_documents=args.validation_documents)  # fmt: skip
    common.print_evaluation(metrics)

    final = os.path.join(args.output_dir, "final")
    common.save_final_model(
        trainer.model,
        final,
        tokenizer_or_processor=tokenizer,
        log_history=trainer.state.log_history,
        datasets=datasets,
        notes=[f"Validation figures: {args.validation_note}, none of them seen in training."],
    )
    common.finish_run(args, final, metrics)
    return metrics


if __name__ == "__main__":
    common.run_recipe(main)
