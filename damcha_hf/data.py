"""Data helpers shared by the recipes and `damcha-hf demo`: tokenizers, text corpora, images.

Text:
    byte_level_tokenizer()            a `PreTrainedTokenizerFast` over the 256 bytes (id == byte value) plus
                                      `<|endoftext|>`; saves with `save_pretrained`, loads with `AutoTokenizer`
    train_bpe_tokenizer(texts, n)     a byte-level BPE tokenizer trained with `tokenizers`
    token_byte_lengths(tokenizer)     how many UTF-8 bytes each token id stands for (bits-per-byte accounting)
    load_text_corpus(data)            a `datasets.DatasetDict` (train / validation) from a file, folder, glob,
                                      `"stdlib"` (the Python standard library's sources, on every machine) or
                                      `"gcide"` (the GCIDE dictionary, read through gzip)
    read_gcide_bytes(path, n)         the GCIDE dictionary's first `n` bytes (byte-level language modelling); the
                                      dictionary is read from $DAMCHA_GCIDE_PATH if set, else where Debian's
                                      `dict-gcide` puts it
    load_dataset_splits(...)          `train` / `validation` of a dataset named as transformers' examples name it:
                                      a Hub id, a local or `save_to_disk` folder, or txt/json/jsonl/csv/parquet
                                      files; split and column checks; `streaming=True` gives iterable splits
    group_into_blocks(...)            tokenised, concatenated, cut into `block_size` blocks for causal LM
    stream_into_blocks(...)           the same on the fly, for a stream
    check_tokenizer_matches_model(tokenizer, config)

Images:
    load_fashion_mnist(folder, split) the Fashion-MNIST idx files as a `datasets.Dataset` of PIL images + labels
    read_fashion_mnist(folder, split) the same as numpy arrays (images, labels)
    load_image_folder(path)           `datasets`' `imagefolder` loader, with the checks it lacks

Every loader fails with an error that names the bad argument and the fix: a missing path, an empty corpus, a
dataset without the named column, a tokenizer with more ids than the model has embeddings.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import gzip
import json
import math
import os
import random
import struct
import sysconfig
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from . import data_sources
from .data_sources import FASHION_MNIST_DIR

END_OF_TEXT = "<|endoftext|>"
NUM_BYTES = 256
BYTE_LEVEL_VOCAB_SIZE = NUM_BYTES + 1  # the bytes, then <|endoftext|> (also used as BOS and padding)

FASHION_MNIST_LABELS = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
# Validation is drawn from at least this many held-out documents (files, or sections of a one-file corpus), so that
# no single document (a ROT13 file, one dictionary letter) stands for the corpus.
MIN_VALIDATION_DOCUMENTS = 8
MAX_SECTION_BYTES = 64 * 1024  # a one-file corpus is cut into sections of whole lines, at most about this long

# Folders of the standard library that are not its own library text: the test suite (20 MB of fixtures, much of it
# generated), IDLE, lib2to3 and third-party packages.
_STDLIB_EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------------------------------- tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, which `tokenizers`' ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, shifted = {}, 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(NUM_BYTES + shifted)
            shifted += 1
    return mapping


def _wrap(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=None,
        pad_token=END_OF_TEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def byte_level_tokenizer(model_max_length: int = 1_000_000) -> PreTrainedTokenizerFast:
    """A tokenizer whose id for each UTF-8 byte is the byte's value, plus `<|endoftext|>` (id 256).

    Built with `tokenizers` (a BPE model with no merges over GPT-2's byte alphabet), so it is an ordinary fast
    tokenizer: `save_pretrained` writes `tokenizer.json` and `AutoTokenizer.from_pretrained` loads it back, with no
    custom code. Every text round-trips exactly, and one token is one byte, so the loss in bits per token is the
    bits per byte (the enwik8 measure).
    """
    alphabet = bytes_to_unicode()
    vocab = {alphabet[byte]: byte for byte in range(NUM_BYTES)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    # No regex split: a byte-level model needs no word boundaries, and `add_prefix_space` would add bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([END_OF_TEXT])
    return _wrap(tokenizer, model_max_length)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, model_max_length: int = 1_000_000
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2's scheme) on `texts` with `tokenizers`; `<|endoftext|>` is id 0.

    The 256 byte symbols are always in the vocabulary, so no text is ever out of vocabulary.
    """
    if vocab_size < NUM_BYTES + 1:
        raise ValueError(
            f"train_bpe_tokenizer: `vocab_size` ({vocab_size}) must be at least {NUM_BYTES + 1} (the 256 bytes and "
            "<|endoftext|>); use the byte-level tokenizer for exactly that, or ask for more (e.g. 4096)."
        )
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrap(tokenizer, model_max_length)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """`lengths[id]`: the number of UTF-8 bytes token `id` stands for (0 for special tokens).

    Exact for byte-level tokenizers (the byte-level and BPE tokenizers above, GPT-2's); for other tokenizers the
    decoded text's UTF-8 length. Used to turn a loss in nats per token into bits per byte.
    """
    byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()}
    special_ids = set(tokenizer.all_special_ids)
    lengths = np.zeros(len(tokenizer), dtype=np.int64)
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in special_ids or token is None:
            continue
        if all(char in byte_of_char for char in token):
            lengths[token_id] = len(token)
        else:
            lengths[token_id] = len(tokenizer.decode([token_id]).encode("utf-8"))
    return lengths


def check_tokenizer_matches_model(tokenizer, config) -> None:
    """Raise if the tokenizer can produce ids the model has no embedding for."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's `vocab_size` is {config.vocab_size}: ids "
            f"{config.vocab_size}..{len(tokenizer) - 1} would index past the embedding table. Build the model with "
            f"`vocab_size={len(tokenizer)}` (or more), or use the tokenizer the model was trained with."
        )


# ------------------------------------------------------------------------------------------------------ corpora


def stdlib_corpus_files() -> list[str]:
    """The `*.py` files of the running Python's standard library (its code and docstrings), sorted by path.

    Every machine with Python has them, which makes them the default corpus of `damcha-hf demo`: about 600 files,
    11 MB, once the test suite, IDLE, lib2to3 and third-party packages are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        str(path)
        for path in root.rglob("*.py")
        if not _STDLIB_EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    if not files:
        raise FileNotFoundError(f"No standard-library sources (*.py) found under {root}; pass a text file instead.")
    return sorted(files)


def resolve_text_files(data: str | os.PathLike | Sequence[str], pattern: str = "**/*.txt") -> list[str]:
    """A file, a folder (its files matching `pattern`, recursively), a glob, or a list of those -> sorted file paths."""
    if isinstance(data, (list, tuple)):
        return [file for item in data for file in resolve_text_files(item, pattern)]
    data = str(data)
    if os.path.isfile(data):
        return [data]
    if os.path.isdir(data):
        files = sorted(f for f in glob.glob(os.path.join(data, pattern), recursive=True) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(
                f"The data folder {data!r} has no files matching {pattern!r}; put text files there or pass a "
                "different file pattern."
            )
        return files
    if glob.has_magic(data):
        files = sorted(f for f in glob.glob(data, recursive=True) if os.path.isfile(f))
        if files:
            return files
    raise FileNotFoundError(
        f"Data path {data!r} does not exist. Pass an existing text file, a folder of .txt files, a glob such as "
        "'corpus/*.txt', 'stdlib' (the Python standard library's sources) or 'gcide'."
    )


def read_gcide_bytes(path: str | None = None, max_bytes: int | None = None) -> bytes:
    """The GCIDE dictionary's bytes (a dictd `.dict.dz` file is gzip-compatible), the first `max_bytes` of them."""
    path = path or data_sources.gcide_path()
    message = data_sources.missing_gcide_message(path)
    if message:
        raise FileNotFoundError(message)
    with gzip.open(path, "rb") as handle:
        return handle.read(max_bytes if max_bytes is not None else -1)


def read_gcide(path: str | None = None, max_bytes: int | None = None) -> str:
    """The GCIDE dictionary text, as one string."""
    return read_gcide_bytes(path, max_bytes).decode("utf-8", errors="ignore")


def validation_document_count(documents: int, validation_fraction: float) -> int:
    """How many of `documents` are held out: `validation_fraction` of them, at least MIN_VALIDATION_DOCUMENTS, at
    most half (training keeps the majority), at least one."""
    return max(1, min(documents // 2, max(MIN_VALIDATION_DOCUMENTS, round(documents * validation_fraction))))


def _split_train_validation(dataset: datasets.Dataset, validation_fraction: float, seed: int) -> datasets.DatasetDict:
    if not 0 < validation_fraction < 1:
        raise ValueError(f"`validation_fraction` must be between 0 and 1 (exclusive), got {validation_fraction}.")
    if len(dataset) < 2:
        raise ValueError(
            "The corpus has a single document, too few to hold out a validation split; give more than one file, "
            "or one file with several lines."
        )
    split = dataset.train_test_split(
        test_size=validation_document_count(len(dataset), validation_fraction), seed=seed, shuffle=True
    )
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


def text_sections(lines: Sequence[str], validation_fraction: float) -> list[str]:
    """A one-file corpus as consecutive sections of whole lines, the documents its validation is drawn from: enough
    of them that `validation_fraction` of them is at least MIN_VALIDATION_DOCUMENTS, each at most about
    MAX_SECTION_BYTES (fewer, longer sections would put long stretches of one kind of text in validation)."""
    sizes = np.cumsum([len(line.encode("utf-8")) for line in lines])
    total = int(sizes[-1]) if len(sizes) else 0
    count = max(math.ceil(MIN_VALIDATION_DOCUMENTS / validation_fraction), math.ceil(total / MAX_SECTION_BYTES))
    count = max(1, min(count, len(lines)))
    # Section k ends at the first line whose running size reaches k / count of the text.
    ends = np.unique(np.searchsorted(sizes, [total * k / count for k in range(1, count)], side="left") + 1)
    bounds = [0, *(int(end) for end in ends if 0 < end < len(lines)), len(lines)]
    return ["".join(lines[start:end]) for start, end in zip(bounds, bounds[1:]) if end > start]


# ------------------------------------------------------------------------------------------- sequence-to-sequence


def signature_docstring_pairs(path: str) -> list[dict]:
    """Each documented function and method of the Python file `path` as a `{"source": its signature, "target": the
    first line of its docstring, "document": path}` pair, in file order: a small sequence-to-sequence task (in the
    spirit of CommonGen, short text from a structured input) on text every machine has.

    The signature is `Class.name(arguments) -> annotation` as written (defaults and annotations included); pairs whose
    first docstring line is shorter than 8 characters are left out. A file that does not parse gives no pairs.
    """
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    pairs = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(child)
                first_line = docstring.strip().splitlines()[0].strip() if docstring and docstring.strip() else ""
                if len(first_line) >= 8:
                    returns = f" -> {ast.unparse(child.returns)}" if child.returns else ""
                    source = f"{prefix}{child.name}({ast.unparse(child.args)}){returns}"
                    pairs.append({"source": source, "target": first_line, "document": str(path)})
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return pairs


def load_seq2seq_pairs(
    data: str, *, validation_fraction: float = 0.05, seed: int = 0, max_train_pairs: int | None = None
) -> datasets.DatasetDict:
    """`train` and `validation` splits of `source` / `target` pairs, held out by document so that validation comes
    from files training never saw.

    `data`: `"stdlib"` (`signature_docstring_pairs` of every standard-library file) or a JSON-lines file of
    `{"source": ..., "target": ...}` objects (an optional `"document"` field groups rows; without it each row is its
    own document). The documents are shuffled with `seed` and `validation_document_count` of them held out; with
    `max_train_pairs`, the training files are read only until that many pairs are found (a quick run).
    """
    rng = random.Random(seed)
    if data == "stdlib":
        files = stdlib_corpus_files()
        rng.shuffle(files)
        held_out = validation_document_count(len(files), validation_fraction)
        validation = [pair for path in files[:held_out] for pair in signature_docstring_pairs(path)]
        train = []
        for path in files[held_out:]:
            train += signature_docstring_pairs(path)
            if max_train_pairs is not None and len(train) >= max_train_pairs:
                break
        return datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                                    validation=datasets.Dataset.from_list(validation))  # fmt: skip
    with _no_download_bars():
        rows = datasets.load_dataset("json", data_files=str(data), split="train")
    missing = {"source", "target"} - set(rows.column_names)
    if missing:
        raise ValueError(f"--data {data}: every row needs `source` and `target` fields; missing {sorted(missing)}.")
    documents = rows["document"] if "document" in rows.column_names else list(range(len(rows)))
    names = sorted(set(documents), key=str)
    rng.shuffle(names)
    held_out = set(names[: validation_document_count(len(names), validation_fraction)])
    in_validation = [document in held_out for document in documents]
    validation = rows.select([index for index, chosen in enumerate(in_validation) if chosen])
    train = rows.select([index for index, chosen in enumerate(in_validation) if not chosen])
    if max_train_pairs is not None:
        train = train.select(range(min(max_train_pairs, len(train))))
    return datasets.DatasetDict(train=train, validation=validation)


@contextlib.contextmanager
def _no_download_bars():
    """`datasets.load_dataset` of local files without its "Downloading data" / "Generating ... split" bars: nothing
    is downloaded, and the bars only confuse."""
    bars_were_enabled = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if bars_were_enabled:
            datasets.utils.enable_progress_bars()


def load_text_corpus(
    data: str | os.PathLike | Sequence[str] = "stdlib",
    *,
    validation_fraction: float = 0.05,
    seed: int = 0,
    max_bytes: int | None = None,
    pattern: str = "**/*.txt",
) -> datasets.DatasetDict:
    """Load text into a `DatasetDict` with `train` and `validation` splits of a `"text"` column.

    Args:
        data: `"stdlib"` (the Python standard library's sources, one document per file), `"gcide"` (the GCIDE
            dictionary), a text file (one row per line, line breaks kept, so the rows concatenate back to the
            file), a folder (its files matching `pattern`, one document per file), a glob, or a list of files.
        validation_fraction: share of the documents held out (chosen with `seed`), at least
            MIN_VALIDATION_DOCUMENTS of them where there are twice that many. A one-file corpus (a text file,
            `"gcide"`) counts as consecutive sections of whole lines (`text_sections`), each a row.
        max_bytes: keep only about this many bytes of text (whole documents/lines), for quick runs; a folder still
            gives at least 2 * MIN_VALIDATION_DOCUMENTS files, so validation spans several.
    """
    if str(data) == "gcide":
        lines = read_gcide(max_bytes=max_bytes).splitlines(keepends=True)
        dataset = datasets.Dataset.from_dict({"text": lines})
        documents = False
    else:
        files = stdlib_corpus_files() if str(data) == "stdlib" else resolve_text_files(data, pattern)
        documents = len(files) > 1
        if documents and max_bytes is not None:
            # Pick whole files at random (seeded) until the budget is met, so a small slice still spans the corpus, and
            # enough of them to hold out several for validation.
            shuffled = random.Random(seed).sample(files, len(files))
            files, total = [], 0
            for file in shuffled:
                if total >= max_bytes and len(files) >= 2 * MIN_VALIDATION_DOCUMENTS:
                    break
                files.append(file)
                total += os.path.getsize(file)
            files.sort()
        if all(os.path.getsize(file) == 0 for file in files):
            raise ValueError(f"The corpus {str(data)!r} is empty (its files have no text); point `--data` at text.")
        with _no_download_bars():
            dataset = datasets.load_dataset(
                "text",
                data_files={"train": files},
                sample_by="document" if documents else "line",
                keep_linebreaks=True,
                encoding_errors="replace",
                split="train",
            )
        if not documents and max_bytes is not None:
            lengths = np.cumsum([len(line.encode("utf-8")) for line in dataset["text"]])
            dataset = dataset.select(range(max(1, int(np.searchsorted(lengths, max_bytes)))))
    dataset = dataset.filter(lambda row: len(row["text"]) > 0)
    if len(dataset) == 0 or not any(text.strip() for text in dataset["text"][:1000]):
        raise ValueError(
            f"The corpus {str(data)!r} is empty (no text found); point `--data` at a file with text in it."
        )
    if not documents:
        if not 0 < validation_fraction < 1:
            raise ValueError(f"`validation_fraction` must be between 0 and 1 (exclusive), got {validation_fraction}.")
        dataset = datasets.Dataset.from_dict({"text": text_sections(dataset["text"], validation_fraction)})
    return _split_train_validation(dataset, validation_fraction, seed)


def _offline_hint() -> str:
    offline = data_sources.hub_offline()
    return f" ({offline}=1)" if offline else ""


def _load_named(name: str, config: str | None, streaming: bool):
    """--dataset-name: a `save_to_disk` folder (`load_from_disk`), a local folder of data files or a Hub id
    (`load_dataset`); a Hub id that cannot be reached is refused in one line."""
    if data_sources.saved_dataset_folder(name):
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict(train=loaded)
        if streaming:
            loaded = datasets.IterableDatasetDict({split: rows.to_iterable_dataset() for split, rows in loaded.items()})
        return loaded
    try:
        with _no_download_bars():
            return datasets.load_dataset(name, config, streaming=streaming)
    except (ValueError, FileNotFoundError, ConnectionError, OSError) as error:
        if os.path.isdir(name):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"--dataset-name {name}: `datasets` cannot read this folder ({first})") from None
        raise ValueError(
            f"--dataset-name {name}: not a local folder, and the Hub dataset cannot be loaded{_offline_hint()} "
            f"({type(error).__name__}); check the id and the network, or give a local folder or --train-file"
        ) from None


def _load_files(train_file: str, validation_file: str | None, streaming: bool):
    files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
    builders = {data_sources.data_file_builder(path) for path in files.values()}
    if len(builders) > 1:
        raise ValueError(
            f"--train-file {train_file} and --validation-file {validation_file} are of different kinds; give both "
            "in one format (text, JSON lines, CSV or parquet)"
        )
    builder = builders.pop()
    options = {"keep_linebreaks": True} if builder == "text" else {}
    try:
        with _no_download_bars():
            return datasets.load_dataset(builder, data_files=files, streaming=streaming, **options)
    except Exception as error:  # pyarrow's and the builders' own exceptions, many kinds: said in one line
        if isinstance(error, (KeyboardInterrupt, MemoryError)):
            raise
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        named = " and ".join(f"--{split}-file {path}" for split, path in files.items())
        if "corresponds to no data" in text:
            split = text.split('"')[1] if text.count('"') >= 2 else "train"
            empty = f"--{split}-file {files.get(split, train_file)}"
            raise ValueError(f"{empty}: the {split!r} split is empty (no rows); give a file holding data") from None
        raise ValueError(f"{named}: `datasets` cannot read it as {builder} ({text})") from None


def split_names(splits) -> list[str]:
    return sorted(splits)


def first_row(rows) -> dict | None:
    """The first row of a `Dataset` or `IterableDataset`, or None when it has none."""
    if isinstance(rows, datasets.Dataset):
        return rows[0] if len(rows) else None
    return next(iter(rows.take(1)), None)


def columns_of(rows) -> list[str]:
    """The columns of a `Dataset` or `IterableDataset` (a stream whose features are not known yet: its first row's)."""
    if rows.column_names is not None:
        return list(rows.column_names)
    row = first_row(rows)
    return list(row) if row else []


def held_out_every(validation_fraction: float) -> int:
    """One row in this many is held out for validation when a dataset has no validation split."""
    return max(2, round(1 / validation_fraction))


def row_hash(row: dict) -> int:
    """A stable hash of a row's values (CRC-32 of its JSON), the same in every process and run."""
    return zlib.crc32(json.dumps(row, sort_keys=True, default=repr).encode("utf-8"))


def hold_out_rows(train, validation_fraction: float):
    """(train, validation) of a split without a validation split. Read whole: every `held_out_every`-th row, from
    the first, as run_clm takes a share. Streamed: the rows whose `row_hash` is a multiple of it: a stream's row
    numbers restart in each process's share of its files (`split_dataset_by_node`), so a row's number would put it in
    one process's training and in the validation of the whole; its content does not."""
    every = held_out_every(validation_fraction)
    if isinstance(train, datasets.Dataset):
        indices = np.arange(len(train))
        return train.select(indices[indices % every != 0]), train.select(indices[indices % every == 0])
    return (
        train.filter(lambda row: row_hash(row) % every != 0),
        train.filter(lambda row: row_hash(row) % every == 0),
    )


def load_dataset_splits(
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    train_split: str = "train",
    validation_split: str | None = None,
    validation_fraction: float = 0.05,
    streaming: bool = False,
    columns: dict[str, str] | None = None,
    share_flag: str | None = None,
):
    """Data named the way transformers' examples name it, as `train` and `validation` splits: a `DatasetDict`, or
    with `streaming` an `IterableDatasetDict`.

    `dataset_name`: a Hub id, a local folder of data files or a `save_to_disk` folder, with `dataset_config_name`;
    its `train_split` and `validation_split` (default: `validation` where it has one). `train_file` (and
    `validation_file`): txt, json/jsonl, csv or parquet, by extension. Without a validation split or file, one
    training row in `held_out_every(validation_fraction)` is held out (`hold_out_rows`). `columns` (flag -> column) must exist; a
    missing split, a missing column or an empty split is refused in one line naming what there is. `share_flag`,
    the flag that set `validation_fraction` on the command line, is refused when the data have a validation split.
    """
    if bool(dataset_name) == bool(train_file):
        raise ValueError("give --dataset-name or --train-file (one of them)")
    source = f"--dataset-name {dataset_name}" if dataset_name else f"--train-file {train_file}"
    if dataset_name:
        loaded = _load_named(dataset_name, dataset_config_name, streaming)
    else:
        loaded = _load_files(train_file, validation_file, streaming)
    if train_split not in loaded:
        raise ValueError(f"{source} has no split {train_split!r} (--train-split); its splits are {split_names(loaded)}")
    train = loaded[train_split]
    if validation_split is not None and validation_split not in loaded:
        raise ValueError(
            f"{source} has no split {validation_split!r} (--validation-split); its splits are {split_names(loaded)}"
        )
    validation_split = validation_split or ("validation" if "validation" in loaded else None)
    if validation_split == train_split:
        raise ValueError(f"--validation-split {validation_split} is the training split; name another, or leave it out")
    if first_row(train) is None:
        raise ValueError(f"{source}: the {train_split!r} split is empty; give data with rows in it")
    found = columns_of(train)
    for flag, column in (columns or {}).items():
        if column not in found:
            raise ValueError(
                f"{source} has no column {column!r} ({flag}); its columns are {found}; name one with {flag}"
            )
    if validation_split:
        if share_flag:
            raise ValueError(f"{share_flag} holds out training rows, but {source} has a {validation_split!r} split to "
                             "validate on; leave the flag out")  # fmt: skip
        validation = loaded[validation_split]
        where = (
            f"the {validation_split!r} split of {source}" if dataset_name else f"--validation-file {validation_file}"
        )
        if first_row(validation) is None:
            raise ValueError(f"{where} is empty; give it rows, or leave it out to hold out training rows")
        for flag, column in (columns or {}).items():
            if column not in columns_of(validation):
                raise ValueError(f"{where} has no column {column!r} ({flag}); its columns are "
                                 f"{columns_of(validation)}")  # fmt: skip
    else:
        if isinstance(train, datasets.Dataset) and len(train) < 2:
            raise ValueError(f"{source} has a single training row, too few to hold one out for validation; give a "
                             "validation split or file, or more rows")  # fmt: skip
        train, validation = hold_out_rows(train, validation_fraction)
    kind = datasets.IterableDatasetDict if streaming else datasets.DatasetDict
    return kind(train=train, validation=validation)


def check_column(dataset, column: str, option: str = "--text-column") -> None:
    """Raise if `dataset` (a `Dataset` or `DatasetDict`) lacks `column`, listing the columns it has."""
    splits = dataset.values() if isinstance(dataset, datasets.DatasetDict) else [dataset]
    for split in splits:
        if column not in split.column_names:
            raise ValueError(
                f"The dataset has no column {column!r}; its columns are {split.column_names}. "
                f"Name the right one with `{option}`."
            )


def group_into_blocks(
    dataset: datasets.Dataset | datasets.DatasetDict,
    tokenizer,
    block_size: int,
    *,
    column: str = "text",
    separate_documents: bool = True,
    max_blocks: int | None = None,
    num_proc: int | None = None,
    document_ids: bool = False,
) -> datasets.Dataset | datasets.DatasetDict:
    """Tokenise `column`, concatenate everything and cut it into `block_size` blocks of `input_ids` and `labels`.

    With `separate_documents`, `eos_token` follows each row (right for one document per row, not for lines). The
    tail shorter than a block is dropped, as in the transformers examples. With `document_ids`, a `document` column
    holds the row each block starts in (for `sample_blocks`).
    """
    if block_size < 2:
        raise ValueError(f"`block_size` must be at least 2 (a token and its successor), got {block_size}.")
    check_column(dataset, column)
    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict(
            {
                name: group_into_blocks(
                    split, tokenizer, block_size, column=column, separate_documents=separate_documents,
                    max_blocks=max_blocks, num_proc=num_proc, document_ids=document_ids,
                )
                for name, split in dataset.items()
            }
        )  # fmt: skip
    suffix = tokenizer.eos_token if separate_documents and tokenizer.eos_token else ""

    def tokenize(batch, rows):
        # Whole documents, longer than the model's context by design: they are cut into blocks below, so the
        # tokenizer's "sequence length is longer than the specified maximum" warning does not apply (verbose=False
        # skips that check only; the tokenizer's model_max_length is left as it is).
        encoded = tokenizer([text + suffix for text in batch[column]], add_special_tokens=False, verbose=False)
        return {"input_ids": encoded["input_ids"], **({"document": rows} if document_ids else {})}

    def group(batch):
        concatenated = [token for ids in batch["input_ids"] for token in ids]
        usable = len(concatenated) // block_size * block_size
        starts = range(0, usable, block_size)
        blocks = [concatenated[start : start + block_size] for start in starts]
        grouped = {"input_ids": blocks, "labels": [list(block) for block in blocks]}
        if document_ids:
            owners = [row for row, ids in zip(batch["document"], batch["input_ids"]) for _ in ids]
            grouped["document"] = [owners[start] for start in starts]
        return grouped

    # `datasets` caches both maps of a file-backed corpus: a second run on the same data and tokenizer reads them back.
    tokenized = dataset.map(
        tokenize, batched=True, with_indices=True, remove_columns=dataset.column_names, num_proc=num_proc,
        desc="tokenizing",
    )  # fmt: skip
    # Large batches: the tail of each batch (< one block) is dropped, so bigger batches waste less.
    grouped = tokenized.map(
        group, batched=True, batch_size=2000, num_proc=num_proc, desc=f"grouping into blocks of {block_size} tokens"
    )
    if len(grouped) == 0:
        total = sum(len(ids) for ids in tokenized["input_ids"])
        raise ValueError(
            f"The corpus has {total} tokens, fewer than one block of `block_size={block_size}`; give more text or "
            "a smaller block size."
        )
    if max_blocks is not None and len(grouped) > max_blocks:
        grouped = grouped.select(range(max_blocks))
    return grouped


def stream_into_blocks(
    rows: datasets.IterableDataset, tokenizer, block_size: int, *, column: str = "text", separate_documents: bool = True
) -> datasets.IterableDataset:
    """`group_into_blocks` on the fly, for a stream: each batch of rows is tokenised (`eos_token` after each row with
    `separate_documents`), concatenated and cut into `block_size` blocks of `input_ids` and `labels` as it is read;
    the tail of each batch shorter than a block is dropped."""
    if block_size < 2:
        raise ValueError(f"`block_size` must be at least 2 (a token and its successor), got {block_size}.")
    suffix = tokenizer.eos_token if separate_documents and tokenizer.eos_token else ""

    def tokenize_and_group(batch):
        # Documents longer than the context by design (cut into blocks here): no length warning (see above).
        encoded = tokenizer([text + suffix for text in batch[column]], add_special_tokens=False, verbose=False)
        concatenated = [token for ids in encoded["input_ids"] for token in ids]
        usable = len(concatenated) // block_size * block_size
        blocks = [concatenated[start : start + block_size] for start in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    return rows.select_columns([column]).map(tokenize_and_group, batched=True, batch_size=1000,
                                             remove_columns=[column])  # fmt: skip


def sample_blocks(blocks: datasets.Dataset, count: int | None, *, seed: int = 0) -> tuple[datasets.Dataset, int]:
    """(`count` blocks drawn at random with `seed`, in corpus order; how many documents they start in).

    Taking the first blocks would take the first documents only; a seeded draw spreads a small validation set over
    every held-out document and stays the same for a seed. `blocks` needs the `document` column of
    `group_into_blocks(..., document_ids=True)`, which the result drops.
    """
    count = len(blocks) if count is None else min(count, len(blocks))
    chosen = sorted(random.Random(seed).sample(range(len(blocks)), count))
    sample = blocks.select(chosen)
    return sample.remove_columns("document"), len(set(sample["document"]))


# ------------------------------------------------------------------------------------------------------- images


def _read_idx(path: str) -> np.ndarray:
    """An idx file (the MNIST format: magic, dimension sizes, big-endian; `.gz` or plain) as a numpy array."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"idx file {path!r} not found; pass the folder that holds the Fashion-MNIST files.")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        data = handle.read()
    zero, dtype_code, num_dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path!r} is not an unsigned-byte idx file (magic {data[:4].hex()}).")
    shape = struct.unpack(f">{num_dims}I", data[4 : 4 + 4 * num_dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * num_dims).reshape(shape)


def read_fashion_mnist(folder: str = FASHION_MNIST_DIR, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's idx files as arrays: images (N, 28, 28) and labels (N,), unsigned bytes.

    `split` is `"train"` (60,000 images) or `"test"` (10,000; the `t10k-*` files).
    """
    if split not in data_sources.FASHION_MNIST_FILES:
        raise ValueError(f"Fashion-MNIST `split` must be 'train' or 'test' (the t10k-* files), got {split!r}.")
    message = data_sources.missing_fashion_mnist_message(folder, (split,), "pass the folder that holds them")
    if message:
        raise FileNotFoundError(message[0].upper() + message[1:] + ".")
    images_file, labels_file = data_sources.FASHION_MNIST_FILES[split]
    images = _read_idx(data_sources.fashion_mnist_file(folder, images_file))
    labels = _read_idx(data_sources.fashion_mnist_file(folder, labels_file))
    if len(images) != len(labels):
        raise ValueError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels.")
    return images, labels


def load_fashion_mnist(
    folder: str = FASHION_MNIST_DIR, split: str = "train", *, max_samples: int | None = None
) -> datasets.Dataset:
    """Fashion-MNIST from its idx files: a `Dataset` with an `image` (28x28 grayscale PIL) and a `label` column
    (`split` as in `read_fashion_mnist`)."""
    from PIL import Image

    images, labels = read_fashion_mnist(folder, split)
    if max_samples is not None:
        images, labels = images[:max_samples], labels[:max_samples]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=FASHION_MNIST_LABELS)})
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(array, mode="L") for array in images], "label": labels.tolist()},
        features=features,
    )


def load_image_folder(path: str, *, validation_fraction: float = 0.1, seed: int = 0) -> datasets.DatasetDict:
    """An image-classification folder (`path/<label>/<image>`, or with `train/` and `validation/`/`test/` inside)
    through `datasets`' `imagefolder` loader, with `train` and `validation` splits and a `label` column."""
    message = data_sources.image_folder_error(path)
    if message:
        raise (FileNotFoundError if not os.path.isdir(path) else ValueError)(f"Image folder {message}.")
    with _no_download_bars():
        loaded = datasets.load_dataset("imagefolder", data_dir=path)
    check_column(loaded, "label", option=f"an image folder laid out as {data_sources.IMAGE_FOLDER_LAYOUT}")
    if "validation" not in loaded and "test" in loaded:
        loaded["validation"] = loaded.pop("test")
    if "validation" not in loaded:
        try:
            split = loaded["train"].train_test_split(
                test_size=validation_fraction, seed=seed, stratify_by_column="label"
            )
        except ValueError:  # too few images per class to stratify
            split = loaded["train"].train_test_split(test_size=validation_fraction, seed=seed)
        loaded = datasets.DatasetDict(train=split["train"], validation=split["test"])
    return loaded
