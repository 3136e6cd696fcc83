"""`--model-name-or-path` in train_gpt2.py (every decoder family), train_vit.py and train_bart.py: a stock checkpoint is
converted with the stock model's outputs (the oracle) before the first step, trained with its own tokenizer or image
processor, saved Hub-ready and reloaded with and without the plugin; a DAMCHA checkpoint is fine-tuned as it is."""

import json

import numpy as np
import pytest
import torch
from conftest import (
    load_checkpoints_in_fresh_process,
    load_recipe,
    needs_auto_image_processor,
    tiny_bart_config,
    tiny_vit_config,
)
from PIL import Image
from tiny_checkpoints import DECODER_TYPES, END_OF_TEXT, VOCAB, stock_decoder, write_stock_decoder
from tokenizers import processors
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BartForConditionalGeneration,
    ViTForImageClassification,
    ViTImageProcessor,
)

from damcha_hf.data import byte_level_tokenizer
from damcha_hf.families import family_for_model_type

QUICK = ["--max-steps", "2", "--batch-size", "2", "--logging-steps", "1", "--max-eval-samples", "4",
         "--num-threads", "1", "--learning-rate", "1e-2"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "a", "runs", "far"]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(" ".join(rng.choice(words, 10)) + "\n" for _ in range(200)))
    return str(path)


def token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))


def logits_of(model, **inputs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def trained_decoders(tmp_path_factory, corpus) -> dict:
    """Each decoder family's tiny stock checkpoint, fine-tuned 2 steps by train_gpt2.py: {model_type: (stock, final)}."""
    recipe = load_recipe("train_gpt2")
    runs = {}
    for model_type in DECODER_TYPES:
        root = tmp_path_factory.mktemp(f"pretrained-{model_type}")
        stock = write_stock_decoder(root / "stock", model_type)
        recipe.main(["--model-name-or-path", str(stock), "--data", corpus, "--block-size", "16", *QUICK,
                     "--output-dir", str(root / "run")])  # fmt: skip
        runs[model_type] = (stock, root / "run" / "final")
    return runs


@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_a_stock_decoder_converts_with_the_stock_outputs_before_training(model_type, tmp_path, corpus):
    stock_folder = write_stock_decoder(tmp_path / "stock", model_type)
    recipe = load_recipe("train_gpt2")
    args = recipe.parse_args(["--model-name-or-path", str(stock_folder), "--data", corpus,
                              "--output-dir", str(tmp_path / "run")])  # fmt: skip
    tokenizer = recipe.build_tokenizer(args, None, resumed=False)
    assert tokenizer.pad_token == "<|endoftext|>" and len(tokenizer) == END_OF_TEXT + 1  # its own, padded with eos
    model = recipe.build_model(args, tokenizer)
    family = family_for_model_type(model_type)
    assert type(model) is family.task_head.model_class
    assert any("cross_head_metric" in name for name, _ in model.named_parameters())
    ids = token_ids()
    torch.testing.assert_close(logits_of(model, input_ids=ids), logits_of(stock_decoder(model_type), input_ids=ids))


@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_a_converted_decoder_trains_saves_and_reloads_with_and_without_the_plugin(model_type, trained_decoders):
    stock_folder, final = trained_decoders[model_type]
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == f"damcha_{model_type}" and config["auto_map"]["AutoModelForCausalLM"]
    assert (final / "README.md").is_file() and (final / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    stock = stock_decoder(model_type)
    trained = dict(reloaded.named_parameters())
    changed = [name for name, parameter in stock.named_parameters() if not torch.equal(parameter, trained[name])]
    assert changed, "two steps of training left every pretrained weight as it was"
    # Its own tokenizer, saved as the repository saves tokenizers (also in tokenizer/, loadable without remote code).
    for tokenizer in (
        AutoTokenizer.from_pretrained(final),
        AutoTokenizer.from_pretrained(final, subfolder="tokenizer"),
    ):
        assert tokenizer("héllo")["input_ids"] == list("héllo".encode())


def test_every_converted_decoder_reloads_without_the_plugin(trained_decoders, tmp_path):
    ids = token_ids(1)
    checkpoints = [(final, {"input_ids": ids}, ["AutoModelForCausalLM"]) for _, final in trained_decoders.values()]
    reports = load_checkpoints_in_fresh_process(checkpoints, tmp_path)
    for (model_type, (_, final)), report in zip(trained_decoders.items(), reports, strict=True):
        assert not report["damcha_hf_importable"] and not report["plugin_modules"]
        module, name = report["classes"]["AutoModelForCausalLM"]
        assert (
            module.startswith("transformers_modules")
            and name == type(AutoModelForCausalLM.from_pretrained(final)).__name__
        ), model_type
        torch.testing.assert_close(
            report["logits"], logits_of(AutoModelForCausalLM.from_pretrained(final), input_ids=ids)
        )


def test_a_damcha_checkpoint_is_fine_tuned_as_it_is(trained_decoders, tmp_path, corpus, capsys):
    _, final = trained_decoders["qwen2"]
    recipe = load_recipe("train_gpt2")
    args = recipe.parse_args(["--model-name-or-path", str(final), "--data", corpus,
                              "--output-dir", str(tmp_path / "again")])  # fmt: skip
    capsys.readouterr()
    model = recipe.build_model(args, recipe.build_tokenizer(args, None, resumed=False))
    assert "converted" not in capsys.readouterr().out
    ids = token_ids()
    torch.testing.assert_close(logits_of(model, input_ids=ids),
                               logits_of(AutoModelForCausalLM.from_pretrained(final), input_ids=ids))  # fmt: skip
    # Its variant settings are its own: another value is refused in one line, before any data is read.
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(["--model-name-or-path", str(final), "--metric-hidden-size", "3",
                           "--output-dir", str(tmp_path / "other")])  # fmt: skip
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--metric-hidden-size 3" in line and "as it was trained" in line


def test_pretrained_flags_are_checked_before_any_work(tmp_path, corpus, capsys):
    stock_folder = write_stock_decoder(tmp_path / "stock", "llama")
    recipe = load_recipe("train_gpt2")
    cases = [
        (["--model-name-or-path", str(stock_folder), "--n-layer", "3"], "--n-layer sets the shape of a new model"),
        (["--model-name-or-path", str(tmp_path / "nowhere" / "x")], "no such checkpoint folder"),
        (["--model-name-or-path", str(tmp_path)], "no config.json"),
        # A Hub id, with the Hub offline (as in these tests) and nothing cached.
        (["--model-name-or-path", "nobody-here/no-such-model"], "no model on the Hub could be read"),
    ]
    vit = tmp_path / "vit"
    ViTForImageClassification(tiny_vit_config()).save_pretrained(vit)
    cases.append((["--model-name-or-path", str(vit)], "use recipes/train_vit.py"))
    for index, (flags, expected) in enumerate(cases):
        with pytest.raises(SystemExit) as exit_info:
            recipe.parse_args([*flags, "--data", corpus, "--output-dir", str(tmp_path / f"run{index}")])
        assert exit_info.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert expected in line, line
        assert not (tmp_path / f"run{index}").exists()
    # --init-from keeps its meaning, the checkpoint as it is (a stock one stays stock); the two are refused together.
    args = recipe.parse_args(["--init-from", str(stock_folder), "--data", corpus, "--block-size", "32",
                              "--output-dir", str(tmp_path / "r")])  # fmt: skip
    assert args.model_name_or_path is None
    assert (
        type(recipe.build_model(args, recipe.build_tokenizer(args, None, resumed=False))).__name__ == "LlamaForCausalLM"
    )
    with pytest.raises(SystemExit):
        recipe.parse_args(["--init-from", str(stock_folder), "--model-name-or-path", str(stock_folder), "--data", corpus,
                           "--output-dir", str(tmp_path / "both")])  # fmt: skip
    assert "give one" in capsys.readouterr().err


def write_image_folder(folder, size: int = 16, per_class: int = 6) -> str:
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (folder / label).mkdir(parents=True)
        for index in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / label / f"{index}.png")
    return str(folder)


@needs_auto_image_processor
def test_a_stock_vit_converts_trains_with_its_processor_and_reloads_without_the_plugin(tmp_path):
    torch.manual_seed(0)
    stock = ViTForImageClassification(tiny_vit_config(image_size=16, num_channels=3, num_labels=2)).eval()
    stock.save_pretrained(tmp_path / "stock")
    processor = ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.2] * 3, image_std=[0.3] * 3)
    processor.save_pretrained(tmp_path / "stock")
    images = write_image_folder(tmp_path / "images")
    recipe = load_recipe("train_vit")
    common = ["--model-name-or-path", str(tmp_path / "stock"), "--data", images]
    args = recipe.parse_args([*common, "--output-dir", str(tmp_path / "probe")])
    assert args.image_size == 16  # the checkpoint's
    model = recipe.build_model(args, ["cat", "dog"], 3, 16)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert type(model).__name__ == "DamchaViTForImageClassification"
    torch.testing.assert_close(logits_of(model, pixel_values=pixels), logits_of(stock, pixel_values=pixels))

    recipe.main([*common, *QUICK, "--output-dir", str(tmp_path / "run")])
    final = tmp_path / "run" / "final"
    saved_processor = json.loads((final / "preprocessor_config.json").read_text())
    assert saved_processor["image_mean"] == [0.2] * 3 and saved_processor["image_std"] == [0.3] * 3  # its own
    reloaded = AutoModelForImageClassification.from_pretrained(final)
    assert reloaded.config.id2label == {0: "cat", 1: "dog"}
    (report,) = load_checkpoints_in_fresh_process(
        [(final, {"pixel_values": pixels}, ["AutoModelForImageClassification"])], tmp_path / "fresh"
    )
    assert not report["damcha_hf_importable"]
    torch.testing.assert_close(report["logits"], logits_of(reloaded, pixel_values=pixels))


def framed_byte_tokenizer():
    """The byte-level tokenizer framing each text as BART's does (`<s> text </s>`, here both `<|endoftext|>`)."""
    tokenizer = byte_level_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", END_OF_TEXT)]
    )
    return tokenizer


def test_a_stock_bart_converts_trains_with_its_tokenizer_and_reloads_without_the_plugin(tmp_path):
    special = {"bos_token_id": END_OF_TEXT, "eos_token_id": END_OF_TEXT, "pad_token_id": END_OF_TEXT,
               "decoder_start_token_id": END_OF_TEXT}  # fmt: skip
    torch.manual_seed(0)
    stock = BartForConditionalGeneration(tiny_bart_config(vocab_size=VOCAB, **special)).eval()
    stock.save_pretrained(tmp_path / "stock")
    framed_byte_tokenizer().save_pretrained(tmp_path / "stock")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"source": f"add {i} and {i + 1}", "target": f"{2 * i + 1}"}) + "\n"
                             for i in range(40)))  # fmt: skip
    recipe = load_recipe("train_bart")
    common = ["--model-name-or-path", str(tmp_path / "stock"), "--data", str(pairs)]
    args = recipe.parse_args([*common, "--output-dir", str(tmp_path / "probe")])
    import pretrained_model

    model = pretrained_model.load_pretrained_model(args)
    ids = token_ids()
    inputs = {"input_ids": ids, "decoder_input_ids": token_ids(1)}
    assert type(model).__name__ == "DamchaBartForConditionalGeneration"
    torch.testing.assert_close(logits_of(model, **inputs), logits_of(stock, **inputs))
    # The checkpoint's tokenizer frames the texts itself: the recipe adds no second end token.
    tokenizer = pretrained_model.load_pretrained_tokenizer(args, max_length=64)
    import datasets

    encoded = recipe.tokenized_pairs(args, tokenizer, datasets.Dataset.from_list([{"source": "ab", "target": "c"}]))
    assert encoded[0]["input_ids"] == [END_OF_TEXT, 97, 98, END_OF_TEXT] and encoded[0]["labels"] == [
        END_OF_TEXT, 99, END_OF_TEXT]  # fmt: skip

    recipe.main([*common, *QUICK, "--max-source-length", "24", "--max-target-length", "8",
                 "--output-dir", str(tmp_path / "run")])  # fmt: skip
    final = tmp_path / "run" / "final"
    assert AutoTokenizer.from_pretrained(final)("ab")["input_ids"] == [END_OF_TEXT, 97, 98, END_OF_TEXT]
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(final)
    (report,) = load_checkpoints_in_fresh_process([(final, inputs, ["AutoModelForSeq2SeqLM"])], tmp_path / "fresh")
    assert not report["damcha_hf_importable"]
    torch.testing.assert_close(report["logits"], logits_of(reloaded, **inputs))
