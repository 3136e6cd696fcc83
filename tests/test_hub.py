"""Hub export: model cards, `save_hub_checkpoint`, `push_checkpoint` (HfApi faked at the network), `inspect`."""

import json
import math
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from attention_oracle import oracle_cross_head
from conftest import (
    PYTHON_BLOCK,
    TINY_GPT2_ARGS,
    FakeHub,
    load_in_fresh_process,
    load_recipe,
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_vit_config,
    train_lora_adapter,
)
from huggingface_hub import ModelCard
from PIL import Image
from shipped_code import expected_code
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import damcha_hf
from damcha_hf import hub
from damcha_hf.cli import main as cli_main
from damcha_hf.metric_map import compute_metric_map, write_metric_map

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The model code a GPT-2 checkpoint of the default variant carries: the config and model files and their relative
# imports, with the variant registry importing DAMCHA's and plain attention's declarations only (independent of
# damcha_hf.hub).
GPT2_CODE_FILES = sorted(expected_code(["configuration_damcha_gpt2", "modeling_damcha_gpt2"], "damcha"))

# A Trainer `state.log_history`, in the shape transformers writes it.
LOG_HISTORY = [
    {"loss": 4.5, "grad_norm": 1.2, "learning_rate": 5e-4, "epoch": 0.5, "step": 10},
    {
        "eval_loss": 4.25,
        "eval_runtime": 1.5,
        "eval_samples_per_second": 20.0,
        "eval_steps_per_second": 2.0,
        "epoch": 0.5,
        "step": 10,
    },
    {"loss": 3.875, "grad_norm": 0.9, "learning_rate": 2.5e-4, "epoch": 1.0, "step": 20},
    {
        "eval_loss": 3.75,
        "eval_accuracy": 0.3125,
        "eval_runtime": 1.5,
        "eval_samples_per_second": 20.0,
        "epoch": 1.0,
        "step": 20,
    },
    {
        "train_runtime": 90.0,
        "train_samples_per_second": 7.1,
        "train_steps_per_second": 0.2,
        "total_flos": 1e9,
        "train_loss": 4.1875,
        "epoch": 1.0,
        "step": 20,
    },
]

SECTIONS = [
    "## DAMCHA settings",
    "## How to load",
    "## Learned cross-head metric",
    "## Training details",
    "## Evaluation results",
    "## Limitations",
    "## Citation",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with fewer ids than the tiny model's vocabulary, built offline."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=90, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:70], special_tokens=["<|endoftext|>"]
    )
    tokenizer.train_from_iterator(["def return import class self lambda"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def tiny_lm(**overrides) -> damcha_hf.DamchaGPT2LMHeadModel:
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(**overrides)).eval()
    randomize_cross_head(model, scale=0.3)
    return model


def front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, flags=re.DOTALL)
    assert match, "the card starts with a YAML block"
    return yaml.safe_load(match.group(1))


def model_index_metrics(metadata: dict) -> dict[str, float]:
    (entry,) = metadata["model-index"]
    (result,) = entry["results"]
    return {metric["type"]: metric["value"] for metric in result["metrics"]}


# ----------------------------------------------------------------------------------------------------------- cards


def test_card_metadata_sections_and_results_follow_the_log_history(tmp_path):
    model = tiny_lm()
    card = hub.build_model_card(
        model,
        log_history=LOG_HISTORY,
        base_model="openai-community/gpt2",
        datasets=["wikitext"],
        images={"loss_curve": "loss_curve.png", "metric_heatmap": "metric_heatmap.png"},
    )
    path = tmp_path / "README.md"
    card.save(path)
    loaded = ModelCard.load(path)
    data = loaded.data.to_dict()
    assert data["library_name"] == "transformers"
    assert "damcha" in data["tags"] and "custom_code" in data["tags"]
    assert data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "openai-community/gpt2"
    assert data["datasets"] == ["wikitext"]
    assert data["license"] == "apache-2.0"

    # The model-index holds the last evaluation of the log (bookkeeping keys dropped) and the LM's perplexity.
    metadata = front_matter(path.read_text())
    assert metadata["model-index"][0]["results"][0]["task"]["type"] == "text-generation"
    assert metadata["model-index"][0]["results"][0]["dataset"]["type"] == "wikitext"
    assert model_index_metrics(metadata) == pytest.approx(
        {"loss": 3.75, "accuracy": 0.3125, "perplexity": math.exp(3.75)}
    )

    text = loaded.text
    positions = [text.index(section) for section in SECTIONS]
    assert positions == sorted(positions)
    # step, epoch, training loss, validation loss, accuracy (not measured at step 10)
    assert "| 10 | 0.50 | 4.5000 | 4.2500 | – |" in text
    assert "| 20 | 1.00 | 3.8750 | 3.7500 | 0.3125 |" in text
    assert "runtime" not in text.split("## Evaluation results")[1].split("##")[0]
    assert "- steps: 20" in text and "- mean training loss: 4.1875" in text and "- peak learning rate: 0.0005" in text
    assert "![Training and validation loss](loss_curve.png)" in text
    assert "![Mean cross-head matrix C per layer](metric_heatmap.png)" in text
    assert "trust_remote_code=True" in text and "import damcha_hf" in text
    assert "AutoModelForCausalLM.from_pretrained" in text
    generator = sum(p.numel() for name, p in model.named_parameters() if "cross_head_metric" in name)
    assert f"{generator:,} ({100 * generator / model.num_parameters():.3f}% of the model)" in text
    # The citation names the paper and says that its authors are not recorded, rather than inventing them.
    citation = text.split("## Citation")[1]
    assert hub.PAPER_TITLE in citation and "author =" not in citation and "not recorded" in citation


def table_of(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first markdown table after `heading`."""
    after = text.split(heading, 1)[1]
    table = after[after.index("\n|") + 1 :].split("\n\n", 1)[0].splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    return cells[0], cells[2:]


def test_card_training_table_merges_partial_entries_and_formats_every_number_alike():
    """A log history as the demo and a Trainer write it, with what made odd rows: no epochs, a step with several
    partial evaluation entries (a periodic evaluation, then `evaluate()` after training, then a metric logged on its
    own), an evaluation before the first logged training loss, and a loss that rounds to 2 at four figures."""
    history = [
        {"step": 5, "eval_loss": 2.5, "eval_runtime": 0.1},  # before any training loss was logged
        {"step": 10, "loss": 2.25, "learning_rate": 1e-3},
        {"step": 10, "eval_loss": 2.125, "eval_bits_per_byte": 3.065, "eval_runtime": 0.2},
        {"step": 1000, "loss": 1.99996, "learning_rate": 1e-4},
        {"step": 1000, "eval_loss": 1.7, "eval_runtime": 0.2},  # the periodic evaluation at the last step
        {"step": 1000, "eval_loss": 1.75, "eval_bits_per_byte": 2.5247, "eval_runtime": 0.3},  # evaluate()
        {"step": 1000, "eval_accuracy": 0.5},  # a metric of the same evaluation, logged on its own
    ]
    log = hub.parse_log_history(history)
    assert [entry["step"] for entry in log.eval_entries] == [5, 10, 1000]  # one entry per step, in order
    assert log.final_eval == {"loss": 1.75, "bits_per_byte": 2.5247, "accuracy": 0.5}  # later values win

    text = hub.build_model_card(tiny_lm(), log_history=history).text
    header, rows = table_of(text, "### Training results")
    # no epoch was logged: no epoch column; every loss and metric with four decimals, steps as counts
    assert header == ["step", "training loss", "validation loss", "validation bits_per_byte", "validation accuracy"]
    assert rows == [
        ["5", "–", "2.5000", "–", "–"],
        ["10", "2.2500", "2.1250", "3.0650", "–"],
        ["1,000", "2.0000", "1.7500", "2.5247", "0.5000"],
    ]
    assert all(cell for row in rows for cell in row)  # no empty cell
    assert "- final logged training loss: 2.0000" in text
    # the legend says what each kind of column is: training batches against held-out evaluation
    assert "Training loss: the loss on training batches" in text and "validation: held-out evaluation at" in text
    # the evaluation section shows the same figures as the table's last row, and says nothing differs
    _, evaluation = table_of(text, "## Evaluation results")
    assert ["loss", "1.7500"] in evaluation and ["bits_per_byte", "2.5247"] in evaluation
    assert "differ from the last row" not in text


def test_card_says_why_given_results_differ_from_the_logs_last_evaluation():
    history = [{"step": 1000, "loss": 2.0, "learning_rate": 1e-4},
               {"step": 1000, "eval_loss": 1.7123, "eval_bits_per_byte": 2.4703}]  # fmt: skip
    why = "on the first 256 of the 1,024 validation blocks; the evaluation results below use all 1,024"
    text = hub.build_model_card(
        tiny_lm(), log_history=history, eval_results={"bits_per_byte": 2.4164, "loss_nats_per_byte": 1.6749},
        log_evaluation=why,
    ).text  # fmt: skip
    assert f"validation: held-out evaluation at that step, {why}." in text
    assert (
        "bits_per_byte differs from the last row of the training results (step 1,000): that row is an evaluation "
        f"during training, {why}." in text
    )
    # given results that match the log say nothing more; without a reason given, the card still says they differ
    same = hub.build_model_card(tiny_lm(), log_history=history, eval_results={"bits_per_byte": 2.47030001}).text
    assert "differ" not in same.split("## Evaluation results")[1].split("##")[0]
    other = hub.build_model_card(tiny_lm(), log_history=history, eval_results={"bits_per_byte": 2.4164}).text
    assert "bits_per_byte differs from the last row of the training results (step 1,000)" in other


def test_card_names_the_tested_transformers_releases_from_the_one_list():
    from damcha_hf.modeling.damcha_config import TESTED_TRANSFORMERS

    text = hub.build_model_card(tiny_lm()).text
    limitations = text.split("## Limitations")[1].split("##")[0]
    tested = re.search(
        r"tested with the releases damcha-hf's\s+continuous integration runs \(transformers ([^)]*)\)", limitations
    )
    assert tested, limitations
    assert re.split(r", | and ", tested.group(1)) == list(TESTED_TRANSFORMERS)


def test_card_pipeline_tags_given_results_and_absent_log():
    classifier = damcha_hf.DamchaGPT2ForSequenceClassification(tiny_damcha_gpt2_config(num_labels=3))
    card = hub.build_model_card(classifier, eval_results={"eval_accuracy": 0.75, "eval_f1": 0.5}, datasets="imdb")
    metadata = front_matter(str(card))
    assert metadata["pipeline_tag"] == "text-classification"
    assert model_index_metrics(metadata) == {"accuracy": 0.75, "f1": 0.5}
    assert "No training log was recorded" in card.text and "AutoModelForSequenceClassification" in card.text
    assert "base_model" not in metadata

    base = damcha_hf.DamchaGPT2Model(tiny_damcha_gpt2_config())
    metadata = front_matter(str(hub.build_model_card(base)))
    assert metadata["pipeline_tag"] == "feature-extraction" and "model-index" not in metadata


def test_card_refuses_a_local_base_model_path(tmp_path):
    with pytest.raises(ValueError, match="base_model.*local path.*Hub id"):
        hub.build_model_card(tiny_lm(), base_model=str(tmp_path))


def test_loss_curve_is_a_png_and_needs_a_logged_loss(tmp_path):
    assert hub.write_loss_curve(LOG_HISTORY, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG_SIGNATURE)
    assert not hub.write_loss_curve([{"train_runtime": 1.0, "step": 0}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


# ------------------------------------------------------------------------------------------------ checkpoint folder


def all_text(folder: Path) -> str:
    return "\n".join(path.read_bytes().decode("utf-8", "replace") for path in folder.rglob("*") if path.is_file())


def test_save_hub_checkpoint_writes_everything_atomically(tmp_path):
    model, tokenizer = tiny_lm(), tiny_tokenizer()
    folder = tmp_path / "run" / "hub"
    returned = hub.save_hub_checkpoint(
        model, folder, tokenizer_or_processor=tokenizer, log_history=LOG_HISTORY, datasets=["wikitext"]
    )
    assert returned == folder
    names = {path.name for path in folder.iterdir()}
    assert names == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "README.md", "loss_curve.png", "metric_heatmap.png", ".damcha-hf-files.json", "tokenizer", *GPT2_CODE_FILES,
    } | ({"special_tokens_map.json"} & names)  # fmt: skip
    # The tokenizer again, in a subfolder without config.json: AutoTokenizer loads it without the plugin.
    assert {path.name for path in (folder / "tokenizer").iterdir()} == {
        name for name in names if name.startswith(("tokenizer.", "tokenizer_config", "special_tokens"))
    }
    # The save's record lists every file it wrote, but itself.
    written = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
    assert set(json.loads((folder / ".damcha-hf-files.json").read_text())["files"]) == written - {
        ".damcha-hf-files.json"
    }
    readme = (folder / "README.md").read_text()
    assert "(loss_curve.png)" in readme and "(metric_heatmap.png)" in readme and "| 1 | " in readme  # mass table
    assert str(tmp_path) not in all_text(folder)
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["hub"]  # no temporary folder left beside it

    reloaded = damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(folder).eval()
    inputs = torch.randint(0, 90, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(inputs).logits, model(inputs).logits)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        hub.save_hub_checkpoint(model, folder)

    class BrokenTokenizer:
        def save_pretrained(self, directory):
            Path(directory, "tokenizer.json").write_text("{")
            raise OSError("disk full")

    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    with pytest.raises(OSError, match="disk full"):
        hub.save_hub_checkpoint(model, folder, tokenizer_or_processor=BrokenTokenizer(), overwrite=True)
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before  # the old one, untouched
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["hub"]

    hub.save_hub_checkpoint(model, folder, overwrite=True, metric_heatmap=False)
    assert not (folder / "tokenizer.json").exists() and not (folder / "metric_heatmap.png").exists()
    assert not (folder / "tokenizer").exists()
    assert "No training log was recorded" in (folder / "README.md").read_text()


def test_the_tokenizer_subfolder_is_the_saves_own_and_is_pushed(tmp_path):
    """The copy of the tokenizer in `tokenizer/` is recorded, pushed and replaced with the rest of the checkpoint; a
    file of the user's put in it makes a later save refuse, naming it, with nothing touched; a link leaving the
    folder is refused by the push. A stock model's checkpoint has no such copy: AutoTokenizer reads its top folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from damcha_hf.safe_files import UnsafeOutputError

    def files(folder: Path) -> dict[str, bytes]:
        return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}

    tokenizer = tiny_tokenizer()
    folder = hub.save_hub_checkpoint(
        tiny_lm(), tmp_path / "hub", tokenizer_or_processor=tokenizer, metric_heatmap=False
    )
    copies = {f"tokenizer/{name}" for name in ("tokenizer.json", "tokenizer_config.json")}
    assert copies <= set(hub.upload_plan(folder))
    for name in copies:
        assert files(folder)[name] == files(folder)[name.removeprefix("tokenizer/")]

    hub.save_hub_checkpoint(tiny_lm(), folder, tokenizer_or_processor=tokenizer, metric_heatmap=False, overwrite=True)
    (folder / "tokenizer" / "notes.txt").write_text("mine")
    before = files(folder)
    with pytest.raises(UnsafeOutputError, match="tokenizer/notes.txt"):
        hub.save_hub_checkpoint(tiny_lm(), folder, metric_heatmap=False, overwrite=True)
    assert files(folder) == before

    (folder / "tokenizer" / "notes.txt").unlink()
    outside = tmp_path / "outside"
    (folder / "tokenizer").rename(outside)
    (folder / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(hub.HubPushError, match="outside the checkpoint folder"):
        hub.upload_plan(folder)

    stock = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=4))
    baseline = hub.save_hub_checkpoint(stock, tmp_path / "stock", tokenizer_or_processor=tokenizer)
    assert (baseline / "tokenizer.json").is_file() and not (baseline / "tokenizer").exists()


# ------------------------------------------------------------------------------------------------------------- push


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    return FakeHub(tmp_path / "fake_hub").install(monkeypatch)


def trainer_output_dir(tmp_path: Path, model) -> Path:
    """A checkpoint folder as a training run leaves it: the Hub files plus state that must never be uploaded."""
    folder = hub.save_hub_checkpoint(
        model, tmp_path / "output", tokenizer_or_processor=tiny_tokenizer(), log_history=LOG_HISTORY
    )
    for junk in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "pytorch_model.bin", "train.py"):
        (folder / junk).write_bytes(b"not for the hub")
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": [], "best_model_checkpoint": str(folder)}))
    (folder / "runs").mkdir()
    (folder / "runs" / "events.out.tfevents").write_bytes(b"x")
    (folder / "stray.png").write_bytes(PNG_SIGNATURE)
    return folder


def test_push_uploads_only_the_hub_files_and_the_result_loads_with_remote_code(tmp_path, fake_hub, online):
    model = tiny_lm()
    folder = trainer_output_dir(tmp_path, model)

    url = hub.push_checkpoint(folder, "someone/tiny-damcha", private=True, revision="v1", token="hf_fake")

    assert url == "https://huggingface.co/someone/tiny-damcha/commit/fake"
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "create_branch", "create_commit"]
    assert fake_hub.calls[0][2] == {"private": True, "exist_ok": True, "token": "hf_fake"}
    assert fake_hub.calls[1][2] == {"branch": "v1"}
    repo = fake_hub.root / "someone/tiny-damcha" / "v1"
    uploaded = sorted(str(path.relative_to(repo)) for path in repo.rglob("*") if path.is_file())
    assert uploaded == sorted([
        "README.md", "config.json", "generation_config.json", "loss_curve.png", "metric_heatmap.png",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json", *GPT2_CODE_FILES,
        "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
    ] + (["special_tokens_map.json"] if (folder / "special_tokens_map.json").exists() else []))  # fmt: skip
    for name in uploaded:
        assert (repo / name).read_bytes() == (folder / name).read_bytes() or name == "README.md"
    uploaded_text = all_text(repo)
    assert str(tmp_path) not in uploaded_text and str(Path.home()) not in uploaded_text
    readme = (repo / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-damcha", trust_remote_code=True)' in readme
    assert hub.REPO_PLACEHOLDER not in readme

    inputs = {"input_ids": torch.randint(0, 90, (2, 7))}
    with torch.no_grad():
        expected = model(**inputs).logits
    report = load_in_fresh_process(repo, inputs, ["AutoModelForCausalLM"], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False
    assert report["classes"]["AutoModelForCausalLM"][0].startswith("transformers_modules.")
    assert torch.equal(report["logits"], expected)


def test_a_card_naming_its_local_folder_is_pushed_naming_the_repository(tmp_path, fake_hub, online, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = hub.save_hub_checkpoint(
        tiny_lm(), "runs/demo", tokenizer_or_processor=tiny_tokenizer(), local_folder="runs/demo"
    )
    card = (folder / "README.md").read_text()
    assert 'from_pretrained("runs/demo", trust_remote_code=True)' in card and hub.REPO_PLACEHOLDER not in card
    assert "These snippets load the local folder `runs/demo`" in card

    hub.push_checkpoint(folder, "someone/tiny-damcha", token="hf_fake")
    readme = (fake_hub.root / "someone/tiny-damcha" / "main" / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-damcha", trust_remote_code=True)' in readme
    assert 'AutoTokenizer.from_pretrained("someone/tiny-damcha", subfolder="tokenizer")' in readme
    assert "runs/demo" not in readme and "These snippets load" not in readme and "<!--" not in readme
    # Everything else of the card is pushed as written.
    assert readme == hub.model_card.card_for_repository(card, "someone/tiny-damcha")
    assert len(readme.splitlines()) == len(card.splitlines()) - 2  # the sentence and the blank line after it

    # A folder outside the current one is never named by its absolute path: the placeholder id stands in for it.
    elsewhere = hub.save_hub_checkpoint(tiny_lm(), tmp_path.parent / f"{tmp_path.name}-elsewhere", local_folder=str(
        tmp_path.parent / f"{tmp_path.name}-elsewhere"))  # fmt: skip
    outside = (elsewhere / "README.md").read_text()
    assert hub.REPO_PLACEHOLDER in outside and str(tmp_path.parent) not in outside


def test_push_fails_fast_offline(tmp_path, fake_hub, capsys, monkeypatch):
    folder = tmp_path / "checkpoint"
    tiny_lm().save_pretrained(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubPushError, match="offline mode.*HF_HUB_OFFLINE"):
        hub.push_checkpoint(folder, "someone/tiny-damcha", token="hf_fake")
    assert cli_main(["push", str(folder), "someone/tiny-damcha", "--token", "hf_fake"]) == 2
    assert "offline mode" in capsys.readouterr().err
    assert fake_hub.calls == []


def test_push_fails_fast_without_a_token(tmp_path, fake_hub, online, monkeypatch, capsys):
    folder = tmp_path / "checkpoint"
    tiny_lm().save_pretrained(folder)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(hub.HubPushError, match="no Hugging Face token.*--token.*HF_TOKEN"):
        hub.push_checkpoint(folder, "someone/tiny-damcha")
    assert cli_main(["push", str(folder), "someone/tiny-damcha"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert fake_hub.calls == []


def test_push_refuses_pickled_weights_bad_ids_and_local_paths(tmp_path, fake_hub, online):
    folder = tmp_path / "checkpoint"
    tiny_lm().save_pretrained(folder)
    with pytest.raises(hub.HubPushError, match="not a valid Hub id"):
        hub.push_checkpoint(folder, "no spaces/allowed here", token="hf_fake")
    (folder / "README.md").write_text(f"trained in {folder}\n")
    with pytest.raises(hub.HubPushError, match="README.md contains the local path"):
        hub.push_checkpoint(folder, "someone/tiny-damcha", token="hf_fake")
    (folder / "README.md").unlink()
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(hub.HubPushError, match="no safetensors weights.*pytorch_model.bin"):
        hub.push_checkpoint(folder, "someone/tiny-damcha", token="hf_fake")
    assert fake_hub.calls == []


# ---------------------------------------------------------------------------------------------------------- inspect


@torch.no_grad()
def naive_mean_cross_head(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Oracle: C = I + G(x) on each layer's normalised attention input, averaged over tokens."""
    transformer = model.transformer
    hidden_states = transformer(input_ids, output_hidden_states=True).hidden_states
    heads = model.config.n_head
    matrices = []
    for layer, block in enumerate(transformer.h):
        x = block.ln_1(hidden_states[layer])
        matrices.append(oracle_cross_head(transformer.cross_head_metric, x, heads, heads, layer=layer).mean(dim=(0, 1)))
    return torch.stack(matrices)


def test_metric_map_matches_a_naive_recomputation():
    model = tiny_lm(n_layer=3)
    input_ids = torch.randint(0, 97, (1, 12))
    metric_map = compute_metric_map(model, {"input_ids": input_ids})
    expected = naive_mean_cross_head(model, input_ids)
    torch.testing.assert_close(metric_map.matrices, expected, atol=1e-5, rtol=1e-5)
    assert metric_map.tokens_seen == [12, 12, 12]
    for layer, matrix in enumerate(expected):
        off_diagonal = matrix.abs().sum() - matrix.diagonal().abs().sum()
        assert metric_map.offdiagonal_mass[layer] == pytest.approx(float(off_diagonal / matrix.abs().sum()), rel=1e-5)
        assert 0.05 < metric_map.offdiagonal_mass[layer] < 1

    fresh = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()).eval()  # generator at zero: C = I
    fresh_map = compute_metric_map(fresh)
    assert torch.equal(fresh_map.matrices, torch.eye(4).expand(2, 4, 4)) and fresh_map.offdiagonal_mass == [0.0, 0.0]
    model.config.metric_mask = "diagonal"
    assert compute_metric_map(model).offdiagonal_mass == [0.0, 0.0, 0.0]


def test_inspect_writes_a_png_with_one_panel_per_layer(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "checkpoint"
    tiny_lm(n_layer=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    output = tmp_path / "pictures" / "c.png"

    assert cli_main(["inspect", str(folder), "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r"^layer \d: off-diagonal mass \d\.\d{4}$", printed, flags=re.MULTILINE)) == 3
    assert "(3 panels)" in printed
    assert output.read_bytes().startswith(PNG_SIGNATURE)
    with Image.open(output) as image:
        image.verify()
    with Image.open(output) as image:
        assert image.size == (round((2.6 * 3 + 1.0) * 110), round((2.6 + 0.6) * 110))  # 3 panels in one row

    data = tmp_path / "sample.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # By default the picture goes beside the checkpoint, never into it (its card shows its own) nor the current folder.
    assert cli_main(["inspect", str(folder), "--data", str(data)]) == 0
    assert (tmp_path / f"checkpoint_{hub.METRIC_HEATMAP_FILE}").read_bytes().startswith(PNG_SIGNATURE)
    assert not (folder / hub.METRIC_HEATMAP_FILE).exists() and not any(work.iterdir())
    capsys.readouterr()
    assert cli_main(["inspect", str(folder), "--data", str(data)]) == 2  # an existing picture needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["inspect", str(folder), "--data", str(data), "--overwrite"]) == 0
    own = folder / hub.METRIC_HEATMAP_FILE
    own.write_bytes(b"the checkpoint's own heatmap")
    assert cli_main(["inspect", str(folder), "--output", str(own)]) == 2
    assert "checkpoint's own heatmap" in capsys.readouterr().err and own.read_bytes() == b"the checkpoint's own heatmap"
    # A file damcha-hf did not draw is never replaced, --overwrite or not; one it drew is.
    assert cli_main(["inspect", str(folder), "--output", str(own), "--overwrite"]) == 2
    assert "not a picture damcha-hf drew" in capsys.readouterr().err
    assert own.read_bytes() == b"the checkpoint's own heatmap"
    own.write_bytes((tmp_path / f"checkpoint_{hub.METRIC_HEATMAP_FILE}").read_bytes())
    assert cli_main(["inspect", str(folder), "--output", str(own), "--overwrite"]) == 0
    assert own.read_bytes().startswith(PNG_SIGNATURE)


def test_heatmap_panels_equal_layers_for_wider_stacks(tmp_path):
    model = tiny_lm(n_layer=6)
    metric_map = write_metric_map(model, tmp_path / "six.png")
    assert metric_map.panels == 6 == metric_map.num_layers
    with Image.open(tmp_path / "six.png") as image:  # 4 columns, 2 rows
        assert image.size == (round((2.6 * 4 + 1.0) * 110), round((2.6 * 2 + 0.6) * 110))


def test_push_completes_the_auto_map_of_a_plain_save(tmp_path, fake_hub, online):
    """A checkpoint saved by plain `save_pretrained` of one head is pushed with every Auto class of its family."""

    folder = tmp_path / "vit"
    damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()).save_pretrained(folder)
    hub.push_checkpoint(folder, "someone/tiny-vit", token="hf_fake")
    pushed = json.loads((fake_hub.root / "someone/tiny-vit/main/config.json").read_text())
    assert pushed["auto_map"] == {
        "AutoConfig": "configuration_damcha_vit.DamchaViTConfig",
        "AutoModel": "modeling_damcha_vit.DamchaViTModel",
        "AutoModelForImageClassification": "modeling_damcha_vit.DamchaViTForImageClassification",
        "AutoModelForMaskedImageModeling": "modeling_damcha_vit.DamchaViTForMaskedImageModeling",
    }
    local = json.loads((folder / "config.json").read_text())
    assert {key: value for key, value in pushed.items() if key != "auto_map"} == {
        key: value for key, value in local.items() if key != "auto_map"
    }


def test_inspect_a_vit_checkpoint_on_an_image_folder(tmp_path, capsys):
    folder = tmp_path / "vit"
    model = damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config(num_hidden_layers=3))
    randomize_cross_head(model)
    model.save_pretrained(folder)
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for index in range(2):
        Image.new("RGB", (40, 30), color=(60 * index, 100, 200)).save(pictures / f"{index}.png")
    (pictures / "notes.txt").write_text("not an image")

    assert cli_main(["inspect", str(folder), "--data", str(pictures), "--output", str(tmp_path / "vit.png")]) == 0
    assert "(3 panels)" in capsys.readouterr().out
    assert (tmp_path / "vit.png").read_bytes().startswith(PNG_SIGNATURE)
    assert cli_main(["inspect", str(folder)]) == 0  # random images of the configured size
    assert (tmp_path / f"vit_{hub.METRIC_HEATMAP_FILE}").read_bytes().startswith(PNG_SIGNATURE)
    assert cli_main(["inspect", str(folder), "--data", str(pictures / "notes.txt")]) == 2
    assert "a vision model reads a folder of images" in capsys.readouterr().err


def test_heatmap_colour_scale_is_set_by_the_cross_head_terms():
    from damcha_hf.metric_map import colour_limit

    learned = torch.eye(4).repeat(2, 1, 1)
    learned[1, 0, 3] = -0.02
    learned[0, 2, 1] = 0.015
    assert colour_limit(learned) == pytest.approx(0.02)
    assert colour_limit(torch.eye(4).repeat(3, 1, 1) * 1.5) == pytest.approx(1.5)  # no cross-head terms yet


def lora_adapter_folder(tmp_path: Path, base_reference: str) -> Path:
    """A PEFT adapter folder as `recipes/finetune_lora.py` leaves it, plus files a push must leave behind."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_lm(), LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["cross_head_metric"]))
    model.peft_config["default"].base_model_name_or_path = base_reference
    folder = tmp_path / "adapter"
    model.save_pretrained(folder, save_embedding_layers=False)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text("# adapter\n\n![curve](loss_curve.png)\n")
    (folder / "loss_curve.png").write_bytes(PNG_SIGNATURE)
    for junk in ("optimizer.pt", "training_args.bin", "notes.txt"):
        (folder / junk).write_bytes(b"not for the hub")
    return folder


def test_push_of_a_lora_adapter_uploads_its_files_and_refuses_a_local_base(tmp_path, fake_hub, online):
    """An adapter folder (no config.json) pushes its config, weights, tokenizer, card and card images, nothing else;
    one whose base is a local path, which would load for no one else, is refused before any network call."""
    folder = lora_adapter_folder(tmp_path, "someone/damcha-base")
    hub.push_checkpoint(folder, "someone/damcha-lora", token="hf_fake")
    committed = [call for call in fake_hub.calls if call[0] == "create_commit"]
    expected = {"adapter_config.json", "adapter_model.safetensors", "README.md", "loss_curve.png"}
    expected |= {path.name for path in folder.iterdir() if path.name.startswith(("tokenizer", "special_tokens"))}
    assert set(committed[0][2]["files"]) == expected
    uploaded = fake_hub.root / "someone/damcha-lora/main"
    assert (
        json.loads((uploaded / "adapter_config.json").read_text())["base_model_name_or_path"] == "someone/damcha-base"
    )

    fake_hub.calls.clear()
    for local in ("runs/lora-gpt2/base", "../base", str(tmp_path)):
        config = json.loads((folder / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = local
        (folder / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(hub.HubPushError, match="base_model_name_or_path .* is not a Hub id.*--base-model-id"):
            hub.push_checkpoint(folder, "someone/damcha-lora", token="hf_fake")
    assert fake_hub.calls == []


def test_lora_recipe_push_needs_the_base_hub_id_before_training(tmp_path, capsys, online):
    finetune_lora = load_recipe("finetune_lora")
    base = tmp_path / "base"
    tiny_lm().save_pretrained(base)
    with pytest.raises(SystemExit):
        finetune_lora.parse_args(["--base", str(base), "--push-to-hub", "--output-dir", str(tmp_path / "run")])
    assert "--base-model-id" in capsys.readouterr().err


def test_lora_recipe_push_names_the_pushed_repositories_in_the_adapter_card(tmp_path, fake_hub, online, monkeypatch):
    """`finetune_lora.py --push-to-hub` pushes the base to --base-model-id, then the adapter; the pushed adapter card
    loads the adapter by its repository as created (a bare --hub-model-id lands in the token owner's namespace), not
    by a placeholder path, and its base by --base-model-id."""

    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("finetune_lora")
    train_lora_adapter(recipe, tmp_path, "run", "--push-to-hub", "--base-model-id", "someone/damcha-base",
                       "--hub-model-id", "my-adapter")  # fmt: skip
    commits = [call[1] for call in fake_hub.calls if call[0] == "create_commit"]
    assert commits == ["someone/damcha-base", f"{FakeHub.USER}/my-adapter"]
    card = (fake_hub.root / FakeHub.USER / "my-adapter" / "main" / "README.md").read_text()
    snippets = "\n".join(PYTHON_BLOCK.findall(card))
    assert f'AutoPeftModelForCausalLM.from_pretrained("{FakeHub.USER}/my-adapter"' in snippets
    assert f'PeftModel.from_pretrained(base, "{FakeHub.USER}/my-adapter")' in snippets
    assert 'AutoModelForCausalLM.from_pretrained("someone/damcha-base"' in snippets
    for placeholder in (recipe.ADAPTER_PLACEHOLDER, recipe.BASE_PLACEHOLDER, hub.REPO_PLACEHOLDER):
        assert placeholder not in card
    base_card = (fake_hub.root / "someone" / "damcha-base" / "main" / "README.md").read_text()
    assert 'from_pretrained("someone/damcha-base"' in base_card and hub.REPO_PLACEHOLDER not in base_card


def test_recipe_push_to_hub_goes_through_the_safe_push(tmp_path, fake_hub, online, monkeypatch, capsys):
    """`train_gpt2.py --push-to-hub` uploads the final model through `push_checkpoint` (its Hub files only, never the
    Trainer's checkpoints or state), to --hub-model-id or the --output-dir name; the card's loading snippets name the
    repository in full (a bare name is created in the token owner's namespace); a bad id fails while parsing."""

    recipe = load_recipe("train_gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {index} of a small corpus to push\n" for index in range(300)))
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    for arguments, expected in (([], "--hub-model-id 'my run' is not a valid Hub repository id"),
                                (["--hub-model-id", "a/b/c"], "--hub-model-id 'a/b/c' is not a valid")):  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            recipe.parse_args(["--push-to-hub", "--output-dir", str(tmp_path / "my run"), *arguments])
        assert refused.value.code == 2 and expected in capsys.readouterr().err
    assert fake_hub.calls == []

    output = tmp_path / "tiny-run"
    recipe.main(["--data", str(corpus), *TINY_GPT2_ARGS, "--max-steps", "2", "--output-dir", str(output),
                 "--push-to-hub"])  # fmt: skip
    assert [call[:2] for call in fake_hub.calls] == [("create_repo", "tiny-run"),
                                                     ("create_commit", f"{FakeHub.USER}/tiny-run")]  # fmt: skip
    files = set(fake_hub.calls[1][2]["files"])
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "loss_curve.png"} <= files
    assert files == set(hub.upload_plan(output / "final"))  # the safe push's plan of final/, nothing else
    card = (fake_hub.root / FakeHub.USER / "tiny-run" / "main" / "README.md").read_text()
    assert f'from_pretrained("{FakeHub.USER}/tiny-run"' in card and hub.REPO_PLACEHOLDER not in card
