"""Data named the way transformers' examples name it, through each recipe's data step: --dataset-name (a local
dataset folder, a save_to_disk folder), --train-file / --validation-file by extension, the split and column flags, the
shipped presets, and bad input refused in one line before any work. Oracles: the rows the test wrote, and blocks
packed by hand from their bytes."""

import json
import os
import subprocess
import sys
import zlib

import datasets
import pytest
from conftest import RECIPES_FOLDER, image_rows, load_recipe, word_documents, write_rows

from damcha_hf import data_sources
from damcha_hf.data import BYTE_LEVEL_VOCAB_SIZE, byte_level_tokenizer, load_dataset_splits, stream_into_blocks

sys.path.insert(0, RECIPES_FOLDER)  # the recipes' helper modules (text_data, image_data)
END_OF_TEXT_ID = BYTE_LEVEL_VOCAB_SIZE - 1  # the byte-level tokenizer's <|endoftext|>
RUN_FLAGS = ["--max-steps", "2", "--batch-size", "2", "--num-threads", "1"]
LANGUAGE_MODEL_RECIPES = ("train_gpt2", "train_gpt2_accelerate")


@pytest.fixture(scope="module")
def documents():
    return word_documents(40)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory, documents):
    """The same 40 documents in every format, the text under `content` (beside an `id`) where the format has
    columns; a save_to_disk folder with `train` and `test` splits; a dataset folder of JSON-lines files."""
    folder = tmp_path_factory.mktemp("data")
    rows = [{"id": index, "content": text} for index, text in enumerate(documents)]
    files = {kind: write_rows(folder / f"corpus.{kind}", rows) for kind in ("parquet", "jsonl", "csv")}
    files["txt"] = write_rows(folder / "corpus.txt", [{"text": text} for text in documents])
    saved = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:30]), test=datasets.Dataset.from_list(rows[30:])
    )
    saved.save_to_disk(str(folder / "saved"))
    files["saved"] = str(folder / "saved")
    (folder / "dataset").mkdir()
    write_rows(folder / "dataset" / "train.jsonl", rows[:32])
    write_rows(folder / "dataset" / "validation.jsonl", rows[32:])
    files["dataset"] = str(folder / "dataset")
    return files


def text_args(recipe: str, tmp_path, *flags):
    block = ["--block-size", "16"] if recipe in LANGUAGE_MODEL_RECIPES else []
    return load_recipe(recipe).parse_args([*flags, *RUN_FLAGS, *block, "--output-dir", str(tmp_path / "run")])


def corpus_of(recipe, tmp_path, *flags):
    import text_data

    args = text_args(recipe, tmp_path, *flags)
    return args, text_data.load_language_model_corpus(args)


def streamed_held_out(row: dict, every: int) -> bool:
    """Whether a streamed dataset without a validation split holds `row` out: the CRC-32 of its JSON a multiple."""
    return zlib.crc32(json.dumps(row, sort_keys=True).encode()) % every == 0


def every_tenth(documents):
    """The rows held out at --validation-split-percentage 10: every tenth, from the first."""
    return [text for index, text in enumerate(documents) if index % 10 == 0]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv"])
def test_a_train_file_of_each_format_holds_out_the_same_rows(tmp_path, data_files, documents, kind):
    args, corpus = corpus_of("train_gpt2", tmp_path, "--train-file", data_files[kind], "--text-column-name", "content",
                             "--validation-split-percentage", "10")  # fmt: skip
    assert corpus["validation"]["text"] == every_tenth(documents)
    assert corpus["train"]["text"] == [text for text in documents if text not in every_tenth(documents)]
    assert args.rows_are_documents


def test_a_text_file_is_read_by_lines_and_packed_across_them(tmp_path, data_files, documents):
    args, corpus = corpus_of("train_gpt2", tmp_path, "--train-file", data_files["txt"])
    held_out = set(range(0, 40, 20))  # the default 5%: every 20th line
    assert corpus["train"]["text"] == [text + "\n" for index, text in enumerate(documents) if index not in held_out]
    assert not args.rows_are_documents  # lines run on: no end-of-text between them
    import text_data

    train, _ = text_data.language_model_data(args, byte_level_tokenizer(), corpus)
    stream = list("".join(corpus["train"]["text"]).encode())
    expected = [stream[start : start + 16] for start in range(0, len(stream) // 16 * 16, 16)]
    assert train["input_ids"] == expected


def test_a_save_to_disk_folder_and_its_named_validation_split(tmp_path, data_files, documents):
    _, corpus = corpus_of("train_gpt2", tmp_path, "--dataset-name", data_files["saved"], "--text-column-name",
                          "content", "--validation-split", "test")  # fmt: skip
    assert corpus["train"]["text"] == documents[:30] and corpus["validation"]["text"] == documents[30:]


def test_a_local_dataset_folder_uses_its_validation_split(tmp_path, data_files, documents):
    _, corpus = corpus_of("train_gpt2_accelerate", tmp_path, "--dataset-name", data_files["dataset"],
                          "--text-column-name", "content")  # fmt: skip
    assert corpus["train"]["text"] == documents[:32] and corpus["validation"]["text"] == documents[32:]


def test_blocks_of_documents_end_each_document_with_end_of_text(tmp_path, data_files, documents):
    import text_data

    args, corpus = corpus_of("train_gpt2", tmp_path, "--train-file", data_files["parquet"], "--text-column-name",
                             "content", "--max-eval-samples", "1000")  # fmt: skip
    train, validation = text_data.language_model_data(args, byte_level_tokenizer(), corpus)
    stream = [token for text in corpus["train"]["text"] for token in [*text.encode(), END_OF_TEXT_ID]]
    assert train["input_ids"] == [stream[start : start + 16] for start in range(0, len(stream) // 16 * 16, 16)]
    assert train["labels"] == train["input_ids"]
    held_out = [token for text in corpus["validation"]["text"] for token in [*text.encode(), END_OF_TEXT_ID]]
    assert len(validation) == len(held_out) // 16  # all of them: --max-eval-samples is larger


def test_streamed_blocks_are_the_blocks_packed_by_hand(data_files, documents):
    splits = load_dataset_splits(train_file=data_files["parquet"], streaming=True, columns={"--c": "content"})
    assert isinstance(splits["train"], datasets.IterableDataset)
    blocks = list(stream_into_blocks(splits["train"], byte_level_tokenizer(), 16, column="content"))
    held_out = [text for index, text in enumerate(documents) if streamed_held_out({"id": index, "content": text}, 20)]
    assert held_out  # 3 of the 40 rows, as it happens
    kept = [text for text in documents if text not in held_out]
    stream = [token for text in kept for token in [*text.encode(), END_OF_TEXT_ID]]
    assert [block["input_ids"] for block in blocks] == [
        stream[s : s + 16] for s in range(0, len(stream) // 16 * 16, 16)
    ]
    assert [row["content"] for row in splits["validation"]] == held_out


def test_streamed_shards_of_two_processes_are_disjoint_and_cover_the_data(data_files, documents):
    import text_data

    rows = load_dataset_splits(train_file=data_files["parquet"], streaming=True, validation_file=None)["train"]
    shares = [[row["content"] for row in text_data.shard_for_process(rows, rank, 2)] for rank in (0, 1)]
    assert not set(shares[0]) & set(shares[1]) and shares[0] and shares[1]
    assert sorted(shares[0] + shares[1]) == sorted(row["content"] for row in rows)


def test_the_presets_keep_working_as_datasets(tmp_path):
    args, corpus = corpus_of("train_gpt2", tmp_path, "--data", "stdlib", "--max-data-bytes", "20000")
    assert isinstance(corpus, datasets.DatasetDict) and corpus["train"].column_names == ["text"]
    assert args.rows_are_documents and len(corpus["validation"]) >= 1


# ------------------------------------------------------------------------------------------------- bad input


def refused(recipe: str, tmp_path, capsys, *flags) -> str:
    with pytest.raises(SystemExit) as exit_info:
        text_args(recipe, tmp_path, *flags)
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and message.count("\n") == 1, message
    return message


def test_bad_files_and_flag_combinations_are_refused_while_parsing(tmp_path, capsys, data_files):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    unknown = tmp_path / "corpus.xlsx"
    unknown.write_text("a")
    message = refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["csv"], "--text-column-name", "body")
    assert "no column 'body' (--text-column-name)" in message and "['id', 'content']" in message
    message = refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["parquet"])
    assert "no column 'text'" in message and "['id', 'content']" in message
    assert "is empty" in refused("train_gpt2", tmp_path, capsys, "--train-file", str(empty))
    assert "unknown extension '.xlsx'" in refused("train_gpt2", tmp_path, capsys, "--train-file", str(unknown))
    assert "not both" in refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["txt"], "--dataset-name",
                                 data_files["saved"])  # fmt: skip
    assert "not both" in refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["txt"], "--data", "stdlib")
    assert "applies to --dataset-name" in refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["txt"],
                                                  "--validation-split", "test")  # fmt: skip
    assert "--text-column-name applies to" in refused("train_gpt2", tmp_path, capsys, "--text-column-name", "x")
    assert "--validation-file goes with --train-file" in refused(
        "train_gpt2", tmp_path, capsys, "--dataset-name", data_files["saved"], "--validation-file", data_files["txt"]
    )
    assert "no such folder" in refused("train_vit", tmp_path, capsys, "--dataset-name", "./missing/folder")
    message = refused(
        "train_bart",
        tmp_path,
        capsys,
        "--train-file",
        data_files["csv"],
        "--text-column",
        "content",
        "--summary-column",
        "title",
    )
    assert "no column 'title' (--summary-column)" in message


def test_a_hub_id_offline_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = refused("train_gpt2", tmp_path, capsys, "--dataset-name", "someone/some-corpus")
    assert "HF_HUB_OFFLINE=1" in message and "someone/some-corpus" in message


def test_a_missing_split_or_column_of_a_dataset_names_what_there_is(data_files):
    with pytest.raises(
        ValueError, match=r"has no split 'dev' \(--validation-split\); its splits are \['test', 'train'\]"
    ):
        load_dataset_splits(dataset_name=data_files["saved"], validation_split="dev")
    with pytest.raises(ValueError, match=r"has no split 'all' \(--train-split\)"):
        load_dataset_splits(dataset_name=data_files["saved"], train_split="all")
    with pytest.raises(
        ValueError, match=r"no column 'body' \(--text-column-name\); its columns are \['id', 'content'\]"
    ):
        load_dataset_splits(dataset_name=data_files["dataset"], columns={"--text-column-name": "body"})


def test_a_missing_split_stops_the_recipe_in_one_line_before_any_training(tmp_path, data_files):
    output = tmp_path / "run"
    command = [sys.executable, os.path.join(RECIPES_FOLDER, "train_gpt2.py"), "--dataset-name", data_files["saved"],
               "--text-column-name", "content", "--validation-split", "dev", *RUN_FLAGS, "--block-size", "16", "--output-dir",
               str(output)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in completed.stderr.splitlines() if "error" in line.lower()]
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert len(errors) == 1 and "its splits are ['test', 'train']" in errors[0], completed.stderr[-2000:]
    assert not list(output.glob("checkpoint-*")) and not (output / "final").exists()


# -------------------------------------------------------------------------------------------- other recipes


@pytest.fixture(scope="module")
def image_parquet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    return write_rows(folder / "images.parquet", image_rows(24))


def test_a_parquet_of_images_through_the_vit_data_step(tmp_path, image_parquet):
    import image_data

    args = text_args("train_vit", tmp_path, "--train-file", image_parquet, "--image-column-name", "img",
                     "--label-column-name", "kind", "--validation-split-percentage", "25")  # fmt: skip
    splits, labels, channels, image_size = image_data.image_datasets(args)
    assert labels == ["dark", "light"] and channels == 1 and image_size == 64
    written = image_rows(24)
    held_out = [row for index, row in enumerate(written) if index % 4 == 0]
    assert len(splits["validation"]) == len(held_out) and len(splits["train"]) == 18
    assert [labels[label] for label in splits["validation"]["label"]] == [row["kind"] for row in held_out]
    import io

    import numpy as np
    from PIL import Image

    first = np.asarray(Image.open(io.BytesIO(held_out[0]["img"]["bytes"])))
    assert np.array_equal(np.asarray(splits["validation"][0]["image"]), first)


def test_the_denoiser_takes_images_without_labels(tmp_path, image_parquet):
    pytest.importorskip("diffusers")
    import image_data

    args = text_args("train_diffusion", tmp_path, "--train-file", image_parquet, "--image-column-name", "img")
    splits, labels, _, _ = image_data.image_datasets(args)
    assert len(splits["train"]) + len(splits["validation"]) == 24 and set(splits["train"]["label"]) == {0}
    message_args = ["--train-file", image_parquet, "--image-column-name", "img", "--label-column-name", "kind"]
    with pytest.raises(SystemExit):
        text_args("train_diffusion", tmp_path, *message_args)  # a denoiser has no label flag


def test_an_image_folder_as_dataset_name(tmp_path):
    import image_data
    from PIL import Image

    rows = image_rows(12)
    for index, row in enumerate(rows):
        folder = tmp_path / "images" / row["kind"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.png").write_bytes(row["img"]["bytes"])
    args = text_args("train_vit", tmp_path, "--dataset-name", str(tmp_path / "images"))
    splits, labels, _, _ = image_data.image_datasets(args)
    assert labels == ["dark", "light"] and len(splits["train"]) + len(splits["validation"]) == 12
    assert isinstance(splits["train"][0]["image"], Image.Image)


def test_bart_pairs_from_a_csv_with_run_summarization_column_flags(tmp_path):
    rows = [{"article": f"def f{index}(x)", "headline": f"Return {index}", "other": index} for index in range(20)]
    path = write_rows(tmp_path / "pairs.csv", rows)
    recipe = load_recipe("train_bart")
    args = recipe.parse_args(["--train-file", path, "--text-column", "article", "--summary-column", "headline",
                              "--validation-split-percentage", "10", "--max-steps", "2", "--output-dir",
                              str(tmp_path / "run")])  # fmt: skip
    pairs = recipe.load_pairs(args, None)
    assert pairs["validation"]["source"] == ["def f0(x)", "def f10(x)"]
    assert pairs["validation"]["target"] == ["Return 0", "Return 10"]
    assert pairs["train"].column_names == ["source", "target"] and len(pairs["train"]) == 18


# ------------------------------------------------------------------------------------------------ end to end


def test_train_gpt2_two_steps_on_a_jsonl_file(tmp_path, data_files):
    metrics = load_recipe("train_gpt2").main([
        "--train-file", data_files["jsonl"], "--text-column-name", "content", *RUN_FLAGS, "--block-size", "16", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "4", "--output-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    assert metrics["global_step"] == 2
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert "corpus" in card and str(tmp_path) not in card  # named by its base name, never its path


def test_train_vit_two_steps_on_a_parquet_of_images(tmp_path, image_parquet):
    metrics = load_recipe("train_vit").main([
        "--train-file", image_parquet, "--image-column-name", "img", "--label-column-name", "kind", "--image-size",
        "8", "--patch-size", "4", "--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--max-steps", "2",
        "--batch-size", "4", "--num-threads", "1", "--output-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    assert metrics["global_step"] == 2 and 0 <= metrics["eval_accuracy"] <= 1
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "dark", "1": "light"}


def test_data_file_columns_read_from_the_head(data_files):
    for kind in ("parquet", "jsonl", "csv"):
        assert data_sources.data_file_columns(data_files[kind]) == ["id", "content"]
    assert data_sources.data_file_columns(data_files["txt"]) == ["text"]


def test_a_hub_id_that_cannot_be_loaded_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError) as error:
        load_dataset_splits(dataset_name="someone/some-corpus")
    message = str(error.value)
    assert "\n" not in message and message.startswith("--dataset-name someone/some-corpus: not a local folder")


def test_a_header_only_csv_is_an_empty_split(tmp_path):
    path = tmp_path / "header.csv"
    path.write_text("id,content\n")
    with pytest.raises(ValueError, match=r"--train-file .*header.csv: the .train. split is empty"):
        load_dataset_splits(train_file=str(path))


@pytest.fixture(scope="module")
def pretrained_gpt2(tmp_path_factory) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2-base")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=256,
                        eos_token_id=256, pad_token_id=256)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return str(folder)


def test_lora_takes_a_train_file_with_its_text_column(tmp_path, capsys, data_files, pretrained_gpt2):
    recipe = load_recipe("finetune_lora")
    flags = ["--base", pretrained_gpt2, "--train-file", data_files["parquet"], "--max-steps", "2", "--batch-size", "2",
             "--block-size", "16", "--num-threads", "1", "--lora-rank", "2", "--metric-hidden-size", "8"]  # fmt: skip
    with pytest.raises(SystemExit):
        recipe.parse_args([*flags, "--text-column-name", "content", "--image-column-name", "img", "--output-dir",
                           str(tmp_path / "refused")])  # fmt: skip
    assert "--image-column-name does not apply to a decoder base" in capsys.readouterr().err
    result = recipe.main([*flags, "--text-column-name", "content", "--output-dir", str(tmp_path / "run")])
    assert result["global_step"] == 2


def test_bart_two_steps_on_a_csv_of_pairs(tmp_path):
    rows = [{"article": f"def f{index}(x, y={index})", "headline": f"Return the sum of x and {index}"}
            for index in range(24)]  # fmt: skip
    path = write_rows(tmp_path / "pairs.csv", rows)
    metrics = load_recipe("train_bart").main([
        "--train-file", path, "--text-column", "article", "--summary-column", "headline", "--max-steps", "2",
        "--batch-size", "4", "--d-model", "16", "--layers", "1", "--heads", "2", "--ffn-dim", "32",
        "--bpe-vocab-size", "300", "--metric-hidden-size", "4", "--num-threads", "1", "--output-dir",
        str(tmp_path / "run"),
    ])  # fmt: skip
    assert metrics["global_step"] == 2 and metrics["eval_pairs"] == 2  # every 20th of 24 rows held out: 0 and 20


def test_a_dataset_folder_of_two_parquet_files_streams_one_file_to_each_process(tmp_path, documents):
    import text_data

    (tmp_path / "parts").mkdir()
    for part in (0, 1):
        rows = [{"text": text} for text in documents[part * 20 : (part + 1) * 20]]
        write_rows(tmp_path / "parts" / f"train-{part}.parquet", rows)
    splits = load_dataset_splits(dataset_name=str(tmp_path / "parts"), streaming=True)
    assert splits["train"].num_shards == 2
    shares = [[row["text"] for row in text_data.shard_for_process(splits["train"], rank, 2)] for rank in (0, 1)]
    # The same rows held out in each share as in the whole: their content decides, not their place in the share.
    held_out = {text for text in documents if streamed_held_out({"text": text}, 20)}
    validation = [row["text"] for row in splits["validation"]]
    assert held_out and sorted(validation) == sorted(held_out)
    for part, share in enumerate(shares):
        assert share == [text for text in documents[part * 20 : (part + 1) * 20] if text not in held_out]


def test_image_labels_that_are_not_classes_are_refused(tmp_path):
    import image_data

    rows = [{"img": row["img"], "score": float(index) / 3} for index, row in enumerate(image_rows(8))]
    path = write_rows(tmp_path / "scores.parquet", rows)
    args = text_args("train_vit", tmp_path, "--train-file", path, "--image-column-name", "img", "--label-column-name",
                     "score")  # fmt: skip
    with pytest.raises(ValueError, match=r"--label-column-name score: the train split's column holds .*float"):
        image_data.image_datasets(args)
    args = text_args(
        "train_vit", tmp_path, "--train-file", path, "--image-column-name", "score", "--label-column-name", "img"
    )
    with pytest.raises(ValueError, match=r"--image-column-name score: the column holds .*float.*not images"):
        image_data.image_datasets(args)


def test_flags_a_call_would_not_use_are_refused(tmp_path, capsys, data_files):
    message = refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["txt"], "--max-data-bytes", "100")
    assert "--max-data-bytes applies to --data" in message
    message = refused("train_vit", tmp_path, capsys, "--dataset-name", data_files["saved"], "--fashion-mnist-dir", "x")
    assert "--fashion-mnist-dir applies to --data" in message
    message = refused("train_gpt2", tmp_path, capsys, "--train-file", data_files["txt"], "--validation-file",
                      data_files["txt"], "--validation-split-percentage", "10")  # fmt: skip
    assert "--validation-split-percentage holds out training rows, which --validation-file replaces" in message
    args = text_args("train_gpt2", tmp_path, "--dataset-name", data_files["dataset"], "--text-column-name", "content",
                     "--validation-fraction", "0.2")  # fmt: skip
    import text_data

    with pytest.raises(ValueError, match="--validation-fraction holds out training rows, but .* has a 'validation'"):
        text_data.load_language_model_corpus(args)


def test_a_preset_streams_like_any_dataset(tmp_path, data_files):
    whole_args, whole = corpus_of("train_gpt2", tmp_path, "--data", data_files["txt"], "--max-data-bytes", "100000")
    args, streamed = corpus_of("train_gpt2", tmp_path, "--data", data_files["txt"], "--streaming")
    assert isinstance(streamed, datasets.IterableDatasetDict)
    assert [row["text"] for row in streamed["train"]] == whole["train"]["text"]
    assert args.rows_are_documents == whole_args.rows_are_documents
