"""The language-model recipes' data and models: text data options (the --data presets, and --dataset-name /
--train-file through `datasets` with --text-column-name), the tokenizer, the corpus (of a preset only what a run
needs; with --streaming read as a stream), its blocks (packed on the fly when streamed, each process's share), and new GPT-2 or Llama configs from the size and metric options (checked against the checkpoint on
--resume)."""

from __future__ import annotations

import argparse
import os

import recipe_options
import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources
from damcha_hf.safe_files import checkpoint_checks


def check_resume_tokenizer(args: argparse.Namespace, resume: str) -> None:
    """On resume the checkpoint's tokenizer is used; a --tokenizer given with another one is refused like other
    conflicting flags. `byte` is the tokenizer without merges, `bpe` one with merges, a folder its own tokenizer."""
    if "tokenizer" not in args.explicit or os.path.abspath(args.tokenizer) == os.path.abspath(resume):
        return
    path = os.path.join(resume, "tokenizer.json")
    saved = checkpoint_checks.read_json_file(path, "a tokenizer")
    merges = bool((saved.get("model") or {}).get("merges")) if isinstance(saved, dict) else False
    if args.tokenizer in ("byte", "bpe"):
        matches = merges == (args.tokenizer == "bpe")
        saved_kind = "a BPE tokenizer (with merges)" if merges else "the byte-level tokenizer"
    else:
        given = os.path.join(args.tokenizer, "tokenizer.json")
        matches = os.path.isfile(given) and checkpoint_checks.read_json_file(given, "a tokenizer") == saved
        saved_kind = "another tokenizer"
    if not matches:
        raise ValueError(
            f"--resume {resume}: the checkpoint was trained with {saved_kind}, not --tokenizer {args.tokenizer}. "
            "Leave --tokenizer out (the checkpoint's is used), or start a new run in another --output-dir."
        )


# `--model-type`: the `model_type` of a new model; "damcha" is DAMCHA GPT-2 (the default, kept for older commands).
LANGUAGE_MODEL_TYPES = ("damcha", "damcha_gpt2", "gpt2", "damcha_llama", "llama")


def language_model_config(args: argparse.Namespace, vocab_size: int, tokenizer=None):
    """A new language-model config from the size and metric options: DAMCHA GPT-2 (default), plain GPT-2
    (`--model-type gpt2`), DAMCHA Llama (`--model-type damcha_llama`, grouped-query with `--n-kv-head`) or plain
    Llama (`--model-type llama`)."""
    from transformers import GPT2Config, LlamaConfig

    import damcha_hf

    model_type = getattr(args, "model_type", "damcha")
    special_tokens = {}
    if tokenizer is not None:
        special_tokens = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                          "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    if model_type in ("llama", "damcha_llama"):
        sizes = {
            "vocab_size": vocab_size,
            "max_position_embeddings": args.block_size,
            "hidden_size": args.n_embd,
            "num_hidden_layers": args.n_layer,
            "num_attention_heads": args.n_head,
            "num_key_value_heads": getattr(args, "n_kv_head", None) or args.n_head,
            # SwiGLU has three matrices: 8/3 of the width (rounded up to a multiple of 32) matches GPT-2's 4x MLP size
            "intermediate_size": -(-8 * args.n_embd // 3 // 32) * 32,
            "attention_dropout": args.dropout,
            **special_tokens,
        }
        plain, damcha = LlamaConfig, damcha_hf.DamchaLlamaConfig
    else:
        sizes = {
            "vocab_size": vocab_size,
            "n_positions": args.block_size,
            "n_embd": args.n_embd,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "resid_pdrop": args.dropout,
            "embd_pdrop": args.dropout,
            "attn_pdrop": args.dropout,
            **special_tokens,
        }
        plain, damcha = GPT2Config, damcha_hf.DamchaGPT2Config
    config = (
        plain(**sizes) if model_type in ("gpt2", "llama") else damcha(**sizes, **recipe_options.metric_options(args))
    )
    config._attn_implementation = args.attn
    return config


def language_model_run_name(args: argparse.Namespace) -> str:
    """The default run folder of a language-model recipe: model type, variant and metric context when given, data,
    tokenizer (e.g. `damcha_gpt2-stdlib-byte`, `damcha_gpt2-gcide-bpe`)."""
    model_type = {"damcha": "damcha_gpt2"}.get(args.model_type, args.model_type)
    return recipe_options.run_folder_name(
        model_type, args.cross_head_variant, args.metric_context, data_label(args), args.tokenizer
    )


def use_causal_lm_loss(model):
    """Name the model's loss explicitly: transformers picks it from the class name, finds none in `...LMHeadModel`
    (stock GPT-2 too), warns "`loss_type=None` was set in the config but it is unrecognized" and uses the causal-LM
    loss anyway. Returns `model`."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def add_gpt2_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (new models)")
    group.add_argument("--model-type", choices=LANGUAGE_MODEL_TYPES, default="damcha",
                       help="damcha / damcha_gpt2 (DAMCHA GPT-2, default), gpt2 (plain GPT-2, the baseline), "
                       "damcha_llama (DAMCHA Llama: RoPE, RMSNorm, SwiGLU, grouped-query with --n-kv-head) or llama "
                       "(plain Llama)")  # fmt: skip
    group.add_argument("--n-layer", type=checks.positive_int, default=4)
    group.add_argument("--n-embd", type=checks.positive_int, default=128)
    group.add_argument("--n-head", type=checks.positive_int, default=8, help="must divide --n-embd (default: 8)")
    group.add_argument("--n-kv-head", type=checks.positive_int,
                       help="Llama: key/value heads, dividing --n-head (grouped-query; default: --n-head)")  # fmt: skip
    group.add_argument("--block-size", type=checks.positive_int, default=128,
                       help="context length in tokens (default: 128)")  # fmt: skip
    group.add_argument("--dropout", type=checks.probability, default=0.0)


# Flags of a new language model and the config fields they set: checked against the checkpoint on --resume.
GPT2_MODEL_FLAGS = {"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head", "block_size": "n_positions",
                    **{field: field for field in recipe_options.METRIC_FIELDS}}  # fmt: skip
LLAMA_MODEL_FLAGS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
                     "n_kv_head": "num_key_value_heads", "block_size": "max_position_embeddings",
                     **{field: field for field in recipe_options.METRIC_FIELDS}}  # fmt: skip


def language_model_flags(saved_config: dict) -> dict[str, str]:
    """The resume flags of a saved language-model config: Llama's field names for a Llama checkpoint, else GPT-2's."""
    return LLAMA_MODEL_FLAGS if saved_config.get("model_type") in ("llama", "damcha_llama") else GPT2_MODEL_FLAGS


def check_language_model_resume(args: argparse.Namespace, resume: str | None) -> None:
    """`check_resume_settings` for the language-model recipes: the checkpoint's architecture (`--model-type`, left out:
    taken from the checkpoint) and its sizes under that architecture's field names (Llama's or GPT-2's) win."""
    if not resume:
        return
    saved = run_folder.saved_model_config(resume)
    saved_type = saved.get("model_type")
    if saved_type in LANGUAGE_MODEL_TYPES:
        requested = {"damcha": "damcha_gpt2"}.get(args.model_type, args.model_type)
        if "model_type" in args.explicit and requested != saved_type:
            raise ValueError(
                f"--resume {resume}: the checkpoint is a {saved_type} model, not --model-type {args.model_type}. Leave "
                "--model-type out (the checkpoint's is used), or start a new run in another --output-dir."
            )
        args.model_type = saved_type
    run_folder.check_resume_settings(args, resume, language_model_flags(saved), saved)


def check_new_language_model_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--n-head divides --n-embd; --n-kv-head is Llama's (grouped-query) and divides --n-head."""
    checks.check_heads_divide_width(parser, args.n_embd, args.n_head, width_flag="--n-embd", heads_flag="--n-head")
    if args.n_kv_head is not None:
        if args.model_type not in ("llama", "damcha_llama"):
            parser.error(f"--n-kv-head applies to --model-type llama or damcha_llama (grouped-query attention), not "
                         f"{args.model_type}; leave it out for GPT-2.")  # fmt: skip
        checks.check_heads_divide_width(parser, args.n_head, args.n_kv_head, width_flag="--n-head",
                                        heads_flag="--n-kv-head")  # fmt: skip


def tokenizer_source(text: str) -> str:
    """--tokenizer: 'byte', 'bpe' or a folder holding a saved tokenizer, checked while parsing."""
    if text in ("byte", "bpe") or os.path.isfile(os.path.join(text, "tokenizer_config.json")):
        return text
    found = "is not a folder" if not os.path.isdir(text) else "has no tokenizer_config.json"
    raise argparse.ArgumentTypeError(f"{text!r} {found}; use 'byte', 'bpe' or a folder a tokenizer was saved to")


TEXT_COLUMN_FLAGS = {"--text-column-name": "text_column_name"}


def add_text_data_arguments(parser: argparse.ArgumentParser, *, streaming: bool = True) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default="stdlib",
        type=checks.text_data_source,
        help="a shipped source or local text: a text file, folder of .txt files, glob, 'stdlib' (Python's standard "
        "library sources; default) or 'gcide' (the GCIDE dictionary); or name data with --dataset-name / "
        "--train-file instead",
    )
    group.add_argument("--file-pattern", default="**/*.txt", help="files to read in a --data folder")
    group.add_argument("--max-data-bytes", type=checks.positive_int, help="read only about this many bytes of text")
    group.add_argument("--validation-fraction", type=checks.probability, default=0.05)
    data_sources.add_dataset_arguments(
        group,
        task_columns={"--text-column-name": ("text", "the column of --dataset-name / --train-file holding the text")},
        streaming=streaming,
    )
    group.add_argument("--tokenizer", default="byte", type=tokenizer_source,
                       help="'byte' (default; bits per byte = bits per token), 'bpe' (trained here), "
                       "or a saved tokenizer folder")  # fmt: skip
    group.add_argument("--bpe-vocab-size", type=checks.positive_int, default=4096)


def check_text_data_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The data flags together (`data_sources.check_dataset_arguments`); --streaming needs a tokenizer that is not
    trained on the corpus first."""
    data_sources.check_dataset_arguments(parser, args, columns=TEXT_COLUMN_FLAGS)
    if getattr(args, "streaming", False):
        if args.tokenizer == "bpe":
            parser.error("--streaming: --tokenizer bpe is trained on the whole corpus before training, which a stream "
                         "does not hold; train it once without --streaming and pass its folder, or use 'byte'")  # fmt: skip
        if args.max_data_bytes is not None:
            parser.error("--max-data-bytes applies to a corpus read whole; a stream reads what --max-steps needs")


def data_label(args: argparse.Namespace) -> str:
    """What the data are called (run folder, model card): --dataset-name, --train-file or --data."""
    return getattr(args, "dataset_name", None) or getattr(args, "train_file", None) or args.data


def build_tokenizer(args: argparse.Namespace, corpus):
    """The tokenizer of --tokenizer, its `model_max_length` the context (--block-size), which every checkpoint saves."""
    from transformers import AutoTokenizer

    from damcha_hf.data import byte_level_tokenizer, train_bpe_tokenizer

    if args.tokenizer == "byte":
        return byte_level_tokenizer(model_max_length=args.block_size)
    if args.tokenizer == "bpe":
        size = sum(len(text) for text in corpus["train"]["text"])
        print(f"training a byte-level BPE tokenizer ({args.bpe_vocab_size} tokens) on {size / 1e6:.1f} M characters "
              "of training text with `tokenizers`...", flush=True)  # fmt: skip
        return train_bpe_tokenizer(corpus["train"]["text"], args.bpe_vocab_size, model_max_length=args.block_size)
    if os.path.isdir(args.tokenizer):
        return AutoTokenizer.from_pretrained(args.tokenizer, model_max_length=args.block_size)
    raise ValueError(f"--tokenizer {args.tokenizer!r}: use 'byte', 'bpe' or an existing tokenizer folder.")


# Bytes per token assumed when sizing the text a run reads: exact for the byte-level tokenizer, generous for BPE.
BYTES_PER_TOKEN = {"byte": 1}
BPE_BYTES_PER_TOKEN = 4


def data_bytes_needed(args: argparse.Namespace) -> int:
    """About how many bytes of text a run needs: twice the training tokens of --max-steps (or --max-train-samples)
    and twice the validation tokens of --max-eval-samples (the validation split gets --validation-fraction of it),
    so that a quick run does not read and tokenise a whole corpus."""
    bytes_per_token = BYTES_PER_TOKEN.get(args.tokenizer, BPE_BYTES_PER_TOKEN)
    blocks = args.max_steps * args.batch_size * args.gradient_accumulation_steps
    if args.max_train_samples is not None:
        blocks = min(blocks, args.max_train_samples)
    block_bytes = args.block_size * bytes_per_token
    train = 2 * blocks * block_bytes / (1 - args.validation_fraction)
    validation = 2 * args.max_eval_samples * block_bytes / args.validation_fraction if args.validation_fraction else 0
    return int(max(train, validation, 1 << 16))


def load_language_model_corpus(args: argparse.Namespace):
    """The text corpus of a language-model recipe, `train` and `validation` splits of a `text` column: from
    --dataset-name / --train-file through `datasets`, or the --data preset (all of --max-data-bytes when given, else
    only about what the run needs, `data_bytes_needed`, said in one line). With --streaming, an
    `IterableDatasetDict`."""
    from damcha_hf.data import load_dataset_splits, load_text_corpus

    streaming = getattr(args, "streaming", False)
    if data_sources.uses_datasets_flags(args):
        splits = load_dataset_splits(
            dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
            validation_file=args.validation_file, train_split=args.train_split, validation_split=args.validation_split,
            validation_fraction=args.validation_fraction, share_flag=data_sources.held_out_share_flag(args),
            streaming=streaming,
            columns={"--text-column-name": args.text_column_name},
        )  # fmt: skip
        # A text file's rows are its lines, which run on into each other; any other dataset's rows are documents.
        args.rows_are_documents = not (args.train_file and data_sources.data_file_builder(args.train_file) == "text")
        if args.dataset_name and os.path.isdir(args.dataset_name):
            args.rows_are_documents = splits["train"].info.builder_name != "text"
        splits = splits.select_columns([args.text_column_name])
        return splits if args.text_column_name == "text" else splits.rename_column(args.text_column_name, "text")
    max_bytes = args.max_data_bytes
    if max_bytes is None and not streaming:
        max_bytes = data_bytes_needed(args)
        print(f"reading about {max_bytes / 1e6:.1f} MB of --data {args.data} (what {args.max_steps} steps and "
              f"{args.max_eval_samples} validation blocks need; --max-data-bytes sets it)", flush=True)  # fmt: skip
    # One document per row for folders and 'stdlib'; sections of one text otherwise.
    args.rows_are_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    corpus = load_text_corpus(args.data, validation_fraction=args.validation_fraction, seed=args.seed,
                              max_bytes=max_bytes, pattern=args.file_pattern)  # fmt: skip
    if streaming:  # the preset, streamed like any other dataset
        import datasets

        return datasets.IterableDatasetDict({split: rows.to_iterable_dataset() for split, rows in corpus.items()})
    return corpus


def language_model_data(args: argparse.Namespace, tokenizer, corpus=None):
    """(train blocks, validation blocks) from the data options. The validation blocks are drawn at random (with
    --seed) from every held-out document; `args.validation_documents` and `args.validation_note` say how many
    documents they cover, for the results and the card."""
    from damcha_hf.data import group_into_blocks, sample_blocks

    if corpus is None:
        corpus = load_language_model_corpus(args)
    separate_documents = getattr(args, "rows_are_documents", None)
    if separate_documents is None:  # a corpus read elsewhere: one document per row for folders and 'stdlib'
        separate_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    blocks = group_into_blocks(
        corpus, tokenizer, args.block_size, separate_documents=separate_documents, document_ids=True
    )
    train = blocks["train"].remove_columns("document")
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    validation, args.validation_documents = sample_blocks(blocks["validation"], args.max_eval_samples, seed=args.seed)
    held_out = "documents" if separate_documents else "sections of the text"
    if data_sources.uses_datasets_flags(args):
        held_out = "rows of the validation data"
    args.validation_note = (f"{len(validation)} blocks of {args.block_size} tokens drawn at random (seed {args.seed}) "
                            f"from {args.validation_documents} held-out {held_out}")  # fmt: skip
    print(f"validation: {args.validation_note}", flush=True)
    return train, validation


def shard_for_process(rows, rank: int, world_size: int):
    """This process's share of a streamed split (`datasets.distributed.split_dataset_by_node`): whole shards (files)
    when they divide evenly among the processes, else every `world_size`-th example of the stream as it is finally
    read (the packed blocks, when the tokenizing map follows); the shares are disjoint."""
    if world_size == 1:
        return rows
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(rows, rank=rank, world_size=world_size)


def streaming_language_model_data(args: argparse.Namespace, tokenizer, splits, *, rank: int = 0, world_size: int = 1):
    """(training blocks, validation blocks) of a streamed corpus (`load_language_model_corpus` with --streaming):
    training text tokenized and packed into blocks on the fly (an `IterableDataset`; this process's share under
    several processes), and the first --max-eval-samples blocks of the validation split, read once (every process
    reads the same ones)."""
    import datasets

    from damcha_hf.data import stream_into_blocks

    separate = args.rows_are_documents
    train = stream_into_blocks(shard_for_process(splits["train"], rank, world_size), tokenizer, args.block_size,
                               separate_documents=separate)  # fmt: skip
    if args.max_train_samples is not None:
        train = train.take(args.max_train_samples)
    blocks = stream_into_blocks(splits["validation"], tokenizer, args.block_size, separate_documents=separate)
    validation = datasets.Dataset.from_list(list(blocks.take(args.max_eval_samples)))
    if len(validation) == 0:
        raise ValueError(f"the validation data hold fewer tokens than one block of --block-size {args.block_size}; "
                         "give more validation text or a smaller --block-size")  # fmt: skip
    args.validation_documents = None
    args.validation_note = (f"the first {len(validation)} blocks of {args.block_size} tokens of the validation data "
                            "(streamed)")  # fmt: skip
    print(f"validation: {args.validation_note}", flush=True)
    return train, validation
