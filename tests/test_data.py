"""damcha_hf.data: tokenizers, text corpora, block grouping, Fashion-MNIST idx files, image folders."""

import gzip
import os

import datasets
import numpy as np
import pytest
from conftest import tiny_damcha_gpt2_config, write_gcide, write_idx
from PIL import Image
from transformers import AutoTokenizer

from damcha_hf import data

TEXT = "héllo wörld — ünïcode 🙂\n\tdef f(x):\n        return x ** 2\n"


def test_byte_level_tokenizer_ids_are_bytes_and_round_trip(tmp_path):
    tokenizer = data.byte_level_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer) == data.BYTE_LEVEL_VOCAB_SIZE == 257
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 256
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(TEXT)["input_ids"] == ids
    assert reloaded.decode(ids + [256], skip_special_tokens=True) == TEXT
    assert data.token_byte_lengths(tokenizer).tolist() == [1] * 256 + [0]


def test_bpe_tokenizer_round_trips_and_counts_bytes(tmp_path):
    texts = [f"the cat sat on the mat {i} times; the dog did not\n" for i in range(200)]
    tokenizer = data.train_bpe_tokenizer(texts, vocab_size=300, min_frequency=2)
    assert 257 < len(tokenizer) <= 300
    ids = tokenizer(TEXT + texts[0])["input_ids"]
    assert len(ids) < len((TEXT + texts[0]).encode())  # merges were learned
    assert tokenizer.decode(ids) == TEXT + texts[0]
    lengths = data.token_byte_lengths(tokenizer)
    assert lengths[ids].sum() == len((TEXT + texts[0]).encode("utf-8"))
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_bpe_tokenizer(texts, vocab_size=100)


def test_text_file_is_held_out_as_sections_spread_over_it(tmp_path):
    """One file counts as consecutive sections of whole lines; validation is several of them, chosen with the seed."""
    lines = [f"line {i}: {'x' * (i % 7)}\n" for i in range(400)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines))
    corpus = data.load_text_corpus(str(path), validation_fraction=0.1, seed=3)
    sections = list(corpus["train"]["text"]) + list(corpus["validation"]["text"])
    assert all(section.endswith("\n") for section in sections)  # whole lines
    # Put back in file order (each section starts with its first line's number), they are the file.
    first_line = {section: int(section.split(":")[0].split()[1]) for section in sections}
    assert "".join(sorted(sections, key=first_line.get)) == path.read_text()
    assert len(sections) == 80  # 8 held-out sections at a tenth
    held_out = sorted(first_line[section] for section in corpus["validation"]["text"])
    assert len(held_out) == data.MIN_VALIDATION_DOCUMENTS and held_out[-1] - held_out[0] > 200  # spread, not a tail
    again = data.load_text_corpus(str(path), validation_fraction=0.1, seed=3)
    assert list(again["validation"]["text"]) == list(corpus["validation"]["text"])
    other = data.load_text_corpus(str(path), validation_fraction=0.1, seed=4)
    assert set(other["validation"]["text"]) != set(corpus["validation"]["text"])


def test_folder_is_one_document_per_file(tmp_path):
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\nsecond line\n")
    (tmp_path / "ignored.md").write_text("not a .txt file")
    corpus = data.load_text_corpus(str(tmp_path), validation_fraction=0.2, seed=1)
    texts = sorted(list(corpus["train"]["text"]) + list(corpus["validation"]["text"]))
    assert texts == [f"document {i}\nsecond line\n" for i in range(5)]
    assert len(corpus["validation"]) == 2  # at most half of too few documents for MIN_VALIDATION_DOCUMENTS


def test_a_quick_slice_of_a_folder_still_holds_out_several_documents(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n" * 100)
    corpus = data.load_text_corpus(str(tmp_path), seed=0, max_bytes=2_000)  # one file would do for the bytes
    assert len(corpus["validation"]) >= data.MIN_VALIDATION_DOCUMENTS
    assert len(corpus["train"]) >= data.MIN_VALIDATION_DOCUMENTS


def test_validation_blocks_are_drawn_over_documents(tmp_path):
    tokenizer = data.byte_level_tokenizer()
    documents = [f"{i}" * (40 + 7 * i) for i in range(10)]  # document i is made of the digit i
    blocks = data.group_into_blocks(datasets.Dataset.from_dict({"text": documents}), tokenizer, 16, document_ids=True)
    # Oracle: the document each block starts in, from the token stream (the digit, or the end-of-text after it).
    stream = [token for text in documents for token in [*text.encode(), 256]]
    owner_of_position = [i for i, text in enumerate(documents) for _ in range(len(text) + 1)]
    assert list(blocks["document"]) == [owner_of_position[start] for start in range(0, len(stream) // 16 * 16, 16)]
    sample, covered = data.sample_blocks(blocks, 12, seed=5)
    assert "document" not in sample.column_names and len(sample) == 12
    chosen = [list(blocks["input_ids"]).index(block) for block in sample["input_ids"]]
    assert chosen == sorted(chosen)  # corpus order
    assert covered == len({blocks["document"][index] for index in chosen}) and covered > 3  # not the first blocks only
    assert data.sample_blocks(blocks, 12, seed=5)[0]["input_ids"] == sample["input_ids"]  # same seed, same blocks
    assert data.sample_blocks(blocks, 12, seed=6)[0]["input_ids"] != sample["input_ids"]


def test_group_into_blocks_matches_the_token_stream():
    tokenizer = data.byte_level_tokenizer()
    documents = ["alpha beta gamma\n", "delta epsilon\n", "zeta eta theta iota\n"]
    blocks = data.group_into_blocks(datasets.Dataset.from_dict({"text": documents}), tokenizer, 8)
    stream = [token for doc in documents for token in list(doc.encode()) + [tokenizer.eos_token_id]]
    expected = [stream[i : i + 8] for i in range(0, len(stream) // 8 * 8, 8)]
    assert list(blocks["input_ids"]) == expected
    assert list(blocks["labels"]) == expected
    lines = data.group_into_blocks(
        datasets.Dataset.from_dict({"text": documents}), tokenizer, 8, separate_documents=False
    )
    joined = "".join(documents).encode()
    assert lines["input_ids"][0] == list(joined[:8])


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_text_corpus(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        data.load_text_corpus(str(empty))
    tokenizer = data.byte_level_tokenizer()
    with pytest.raises(ValueError, match="no column 'content'.*--text-column"):
        data.group_into_blocks(datasets.Dataset.from_dict({"text": ["abc"]}), tokenizer, 4, column="content")
    with pytest.raises(ValueError, match="fewer than one block"):
        data.group_into_blocks(datasets.Dataset.from_dict({"text": ["abc"]}), tokenizer, 64)
    with pytest.raises(ValueError, match="vocab_size"):
        data.check_tokenizer_matches_model(tokenizer, tiny_damcha_gpt2_config(vocab_size=97))
    data.check_tokenizer_matches_model(tokenizer, tiny_damcha_gpt2_config(vocab_size=257))
    with pytest.raises(FileNotFoundError, match="Image folder .*no-images is not a folder; expected <folder>/<label>"):
        data.load_image_folder(str(tmp_path / "no-images"))
    with pytest.raises(FileNotFoundError, match="GCIDE dictionary is not at .*apt-get install dict-gcide"):
        data.read_gcide(str(tmp_path / "gcide.dict.dz"))
    # A missing Fashion-MNIST says where Debian puts it and how to get it.
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST folder .*`apt-get install dataset-fashion-mnist`"):
        data.load_fashion_mnist(str(tmp_path / "no-idx"))
    (tmp_path / "empty-idx").mkdir()
    with pytest.raises(FileNotFoundError, match="no t10k-images-idx3-ubyte.*`apt-get install dataset-fashion-mnist`"):
        data.load_fashion_mnist(str(tmp_path / "empty-idx"), "test")


def test_stdlib_corpus_is_the_standard_library():
    files = data.stdlib_corpus_files()
    assert len(files) > 100
    assert any(f.endswith(os.sep + "textwrap.py") for f in files)
    assert not any(f"{os.sep}test{os.sep}" in f or "site-packages" in f for f in files)


def test_gcide_is_read_from_the_file_damcha_gcide_path_names(tmp_path, monkeypatch):
    """`--data gcide` reads the dictionary through gzip (a dictd .dict.dz is gzip-compatible), from $DAMCHA_GCIDE_PATH
    where it is set; a path given to the reader wins over both."""
    path = write_gcide(tmp_path / "gcide.dict.dz", size=300_000)
    with gzip.open(path, "rt") as handle:
        text = handle.read()
    monkeypatch.setenv("DAMCHA_GCIDE_PATH", path)
    assert data.read_gcide() == text and data.read_gcide_bytes(max_bytes=100) == text[:100].encode()
    corpus = data.load_text_corpus("gcide", max_bytes=100_000)
    together = "".join(corpus["train"]["text"]) + "".join(corpus["validation"]["text"])
    assert sorted(together) == sorted(text[: len(together)]) and 100_000 <= len(together) < 100_200
    assert len(corpus["validation"]) >= data.MIN_VALIDATION_DOCUMENTS
    with pytest.raises(FileNotFoundError, match=f"not at {tmp_path}/other.dz;"):
        data.read_gcide(str(tmp_path / "other.dz"))


def test_fashion_mnist_idx_reader(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 28, 28))
    labels = np.array([3, 1, 4, 1, 5, 9])
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    loaded = data.load_fashion_mnist(str(tmp_path), "test", max_samples=5)
    assert len(loaded) == 5
    assert list(loaded["label"]) == labels[:5].tolist()
    assert loaded.features["label"].names[9] == "Ankle boot"
    first = loaded[2]["image"]
    assert first.mode == "L" and first.size == (28, 28)
    np.testing.assert_array_equal(np.asarray(first), images[2])


def test_image_folder(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for label in ("cats", "dogs"):
        (tmp_path / label).mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    loaded = data.load_image_folder(str(tmp_path), validation_fraction=0.2)
    assert len(loaded["train"]) == 16 and len(loaded["validation"]) == 4
    assert loaded["train"].features["label"].names == ["cats", "dogs"]
    # Local files: no "Downloading data" bar (datasets shows one above 16 files).
    assert "Downloading data" not in capsys.readouterr().err


def test_image_folder_errors_name_the_layout_and_what_was_found(tmp_path):
    from damcha_hf.data_sources import image_folder_error

    rng = np.random.default_rng(0)

    def image(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)

    loose = tmp_path / "loose"
    for i in range(3):
        image(loose / f"{i}.png")
    message = image_folder_error(str(loose))
    assert "3 image(s) but no label folders" in message
    assert "expected <folder>/<label>/<image>" in message and "<folder>/train/<label>/<image>" in message
    with pytest.raises(ValueError, match=r"3 image\(s\) but no label folders; expected <folder>/<label>/<image>"):
        data.load_image_folder(str(loose))
    empty_labels = tmp_path / "empty-labels"
    (empty_labels / "cats").mkdir(parents=True)
    assert "1 subfolder(s) (cats) with no images in them" in image_folder_error(str(empty_labels))
    splits = tmp_path / "splits"
    image(splits / "train" / "cats" / "0.png")
    (splits / "validation").mkdir()
    image(splits / "validation" / "1.png")  # loose in validation/: no label
    assert image_folder_error(str(splits)).startswith(f"{splits}: validation/ has 1 image(s) but no label folders")
    image(splits / "validation" / "cats" / "2.png")
    assert image_folder_error(str(splits)) is None
    assert image_folder_error(str(tmp_path / "nothing-here")).endswith(
        "is not a folder; expected "
        + "<folder>/<label>/<image> (one folder per class), or <folder>/train/<label>/<image> with <folder>/validation/<label>/<image> (or test/)"
    )
