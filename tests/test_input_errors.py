"""Bad input fails at once, in one line naming the file, row, flag or field and the fix (exit code 2 for the command
line and the recipes), before any model loads or trains, and leaves nothing on disk. Also: `damcha-hf inspect` on
every family, and the documented `damcha_hf.x.y` names after a plain `import damcha_hf`."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from attention_oracle import oracle_cross_head
from conftest import (
    TINY_BART,
    TINY_VIT,
    load_recipe,
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
    tiny_gpt2_config,
)
from PIL import Image

import damcha_hf
from damcha_hf import safe_files
from damcha_hf.cli import build_parser
from damcha_hf.cli import main as cli_main
from damcha_hf.metric_map import DEFAULT_DENOISER_TIMESTEP, compute_metric_map, random_image_inputs
from damcha_hf.modeling.damcha_config import CROSS_HEAD_VARIANTS, METRIC_CONTEXTS, METRIC_FORMS, METRIC_MASKS
from damcha_hf.safe_files import checkpoint_checks

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def one_line(captured: str) -> str:
    lines = [line for line in captured.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured, captured
    return lines[0]


def files_under(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*"))


def denoiser_config(**overrides) -> damcha_hf.DamchaViTDenoiserConfig:
    fields = {key: value for key, value in TINY_VIT.items() if key != "num_labels"}
    return damcha_hf.DamchaViTDenoiserConfig(
        **{**fields, "time_embedding_size": 16, "metric_hidden_size": 8, **overrides}
    )


# ------------------------------------------------------------------------------ inspect: every family, the denoiser


FAMILY_CHECKPOINTS = {
    "gpt2": (lambda: damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()), 2),
    "llama": (lambda: damcha_hf.DamchaLlamaForCausalLM(tiny_damcha_llama_config()), 2),
    "vit": (lambda: damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()), 2),
    # encoder 0-1, decoder 0-1, cross-attention 0-1
    "bart": (lambda: damcha_hf.DamchaBartForConditionalGeneration(damcha_hf.DamchaBartConfig(**TINY_BART)), 6),
    "vit_denoiser": (lambda: damcha_hf.DamchaViTDenoiserModel(denoiser_config()), 2),
}


@pytest.mark.parametrize("family", FAMILY_CHECKPOINTS)
def test_inspect_draws_every_family_beside_the_checkpoint(family, tmp_path, capsys):
    build, panels = FAMILY_CHECKPOINTS[family]
    model = build()
    randomize_cross_head(model)
    model.save_pretrained(tmp_path / family)
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / family)]) == 0
    printed = capsys.readouterr().out
    assert f"({panels} panels)" in printed
    assert len(re.findall(r"^layer [\w -]+: off-diagonal mass 0\.\d{4}$", printed, flags=re.MULTILINE)) == panels
    picture = tmp_path / f"{family}_{safe_files.METRIC_HEATMAP_FILE}"
    assert picture.read_bytes().startswith(PNG_SIGNATURE)
    assert safe_files.png_text(picture, "Software") == safe_files.PNG_SOFTWARE
    assert not (tmp_path / family / safe_files.METRIC_HEATMAP_FILE).exists()  # never into the checkpoint


@torch.no_grad()
def naive_denoiser_metric(model, pixel_values: torch.Tensor, timestep: int) -> torch.Tensor:
    """Oracle for `metric_context="sequence"`: per layer and image, C = I + G(z) with z the mean
    of the layer's normalised input over its tokens (the time token and the patches), averaged over the images."""
    hidden_states = model(pixel_values, timestep, output_hidden_states=True).hidden_states
    heads = model.config.num_attention_heads
    matrices = []
    for layer, block in enumerate(model.vit.layers):
        z = block.layernorm_before(hidden_states[layer]).mean(dim=1)
        matrices.append(oracle_cross_head(model.vit.cross_head_metric, z, heads, heads, layer=layer).mean(dim=0))
    return torch.stack(matrices)


def test_the_denoisers_metric_map_is_taken_at_a_timestep():
    torch.manual_seed(0)
    model = damcha_hf.DamchaViTDenoiserModel(denoiser_config()).double().eval()
    randomize_cross_head(model)
    pixel_values = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    maps = {step: compute_metric_map(model, {"pixel_values": pixel_values}, timestep=step) for step in (10, 900)}
    for step, metric_map in maps.items():  # float64 oracle, the map rounded once to float32
        expected = naive_denoiser_metric(model, pixel_values, step).to(torch.float32)
        torch.testing.assert_close(metric_map.matrices, expected, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)
        assert metric_map.tokens_seen == [3, 3] and f"at timestep {step}" in metric_map.inputs
    assert not torch.allclose(maps[10].matrices, maps[900].matrices)  # the noise level changes C
    default = compute_metric_map(model, {"pixel_values": pixel_values})
    assert torch.equal(
        default.matrices, compute_metric_map(model, {"pixel_values": pixel_values}, timestep=500).matrices
    )
    assert DEFAULT_DENOISER_TIMESTEP == 500
    with pytest.raises(ValueError, match="timestep=3: DamchaGPT2LMHeadModel is not a diffusion denoiser"):
        compute_metric_map(damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()), timestep=3)


def test_inspect_takes_the_denoiser_at_the_middle_of_its_schedule_or_at_timestep(tmp_path, capsys):
    model = damcha_hf.DamchaViTDenoiserModel(denoiser_config()).eval()
    randomize_cross_head(model)
    folder = tmp_path / "denoiser"
    model.save_pretrained(folder)
    (folder / "scheduler_config.json").write_text(json.dumps({"num_train_timesteps": 100}))
    capsys.readouterr()
    assert cli_main(["inspect", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "noise level: timestep 50 of the 100-step schedule" in printed
    expected = naive_denoiser_metric(model, random_image_inputs(model)[0]["pixel_values"], 50)
    masses = [float(mass) for mass in re.findall(r"off-diagonal mass (\d\.\d{4})", printed)]
    oracle = [float(1 - matrix.diagonal().abs().sum() / matrix.abs().sum()) for matrix in expected]
    assert masses == pytest.approx(oracle, abs=6e-5)  # printed to 4 decimals

    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for index in range(3):
        Image.new("L", (28, 28), color=40 * index).save(pictures / f"{index}.png")
    output = tmp_path / "at-90.png"
    assert cli_main(["inspect", str(folder), "--data", str(pictures), "--timestep", "90", "--output", str(output)]) == 0
    assert "timestep 90 of the 100-step schedule" in capsys.readouterr().out
    assert output.read_bytes().startswith(PNG_SIGNATURE)


def refused_before_loading(argv, capsys, monkeypatch) -> str:
    """Run `damcha-hf argv`: exit code 2, one `error:` line (returned), and no model loaded."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(checkpoint_checks, "loading_checkpoint", no_loading)
    capsys.readouterr()
    try:
        code = cli_main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("damcha-hf inspect: error: "), line
    return line


def test_inspect_refuses_what_it_cannot_draw_before_loading_and_writes_nothing(tmp_path, capsys, monkeypatch):
    transformers.GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "stock")
    damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(cross_head_variant="dcmha")).save_pretrained(
        tmp_path / "dcmha"
    )
    damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    damcha_hf.DamchaViTDenoiserModel(denoiser_config()).save_pretrained(tmp_path / "denoiser")
    damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()).save_pretrained(tmp_path / "vit")
    (tmp_path / "images").mkdir()
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    (tmp_path / "theirs.png").write_bytes(PNG_SIGNATURE + b"a picture someone else drew")
    before = files_under(tmp_path)
    cases = [
        (["stock"], "stock holds a 'gpt2' model, not a DAMCHA checkpoint", "convert it with"),
        (["dcmha"], "runs `cross_head_variant='dcmha'`, which has no cross-head matrix C", "DAMCHA"),
        (["gpt2", "--timestep", "5"], "--timestep applies to a diffusion denoiser", "GPT-2"),
        (["denoiser", "--timestep", "1000"], "--timestep 1000: the denoiser's schedule has timesteps 0 to 999", ""),
        (["gpt2", "--data", "images"], "--data", "is a folder; a text model reads a text file"),
        (["gpt2", "--data", "blank.txt"], "--data", "holds only blank lines"),
        (["vit", "--data", "text.txt"], "--data", "is a file; a vision model reads a folder of images"),
        (["vit", "--data", "images"], "--data", "no images (.png"),
        (["gpt2", "--output", "theirs.png", "--overwrite"], "theirs.png is not a picture damcha-hf drew", "--output"),
    ]
    monkeypatch.chdir(tmp_path)
    for argv, *expected in cases:
        line = refused_before_loading(["inspect", *argv], capsys, monkeypatch)
        assert all(text in line for text in expected), (argv, line)
    assert files_under(tmp_path) == before  # no picture, nothing half-written


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda path: None, "'{data}' does not exist; give a UTF-8 text file (text models) or a folder of images"),
        (lambda path: path.write_bytes(b"\x00\x01binary" * 10), "'{data}' is not a text file (it holds NUL bytes"),
        (lambda path: path.write_bytes(b""), "'{data}' is empty; give a file holding text"),
    ],
    ids=["missing", "binary", "empty"],
)
def test_inspect_checks_data_while_parsing(make, expected, tmp_path, capsys):
    data = tmp_path / "data.txt"
    make(data)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["inspect", str(checkpoint_folder(tmp_path)), "--data", str(data)])
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2
    assert line.startswith("damcha-hf inspect: error: argument --data: ") and expected.format(data=data) in line, line


def checkpoint_folder(parent: Path) -> Path:
    """A folder that passes the parser's checkpoint check (a config.json): parsing reads nothing else of it."""
    folder = parent / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_inspect_data_that_is_neither_a_file_nor_a_folder_is_named_while_parsing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["inspect", str(checkpoint_folder(tmp_path)), "--data", "/dev/null"])
    assert exit_info.value.code == 2
    assert "'/dev/null' is not a regular file or folder" in one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------- the recipes' inputs


def run_recipe(name: str, *arguments: str) -> tuple[int, str]:
    completed = subprocess.run([sys.executable, str(RECIPES / name), *arguments], capture_output=True, text=True,
                               timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    return completed.returncode, one_line(completed.stderr)


PAIR = {"source": "def add(a, b)", "target": "Return a plus b."}


@pytest.mark.parametrize(
    "lines, expected",
    [
        ([PAIR, {"source": "def f()"}], 'pairs.jsonl, line 2: no "target" field; every row needs "source" and "target"'),
        ([PAIR, "not json"], "pairs.jsonl, line 2: not JSON (Expecting value, column 1); write one JSON object per line"),
        ([PAIR, {**PAIR, "target": 5}], 'pairs.jsonl, line 2: "target" is a number (5), not a string; write it as text'),
        ([PAIR, "", [PAIR]], "pairs.jsonl, line 3: an array, not a JSON object"),
        ([PAIR, {**PAIR, "source": " "}], 'pairs.jsonl, line 2: "source" is empty'),
        ([{**PAIR, "document": "a"}, PAIR], 'pairs.jsonl, line 2: no "document" field, unlike the first row'),
        ([PAIR], "pairs.jsonl holds 1 pair; the train/validation split needs at least 2 rows (each row is its own "
                 "document): 1 held out for validation, the rest for training"),
        ([{**PAIR, "document": "a"}] * 3, "pairs.jsonl holds 3 pairs in 1 document; the train/validation split needs "
                                         'at least 2 documents (distinct "document" values)'),
    ],
    ids=["no-target", "not-json", "number-target", "array", "empty-source", "partial-document", "one-row", "one-doc"],
)  # fmt: skip
def test_train_bart_checks_the_pairs_file_while_parsing(lines, expected, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    code, line = run_recipe("train_bart.py", "--data", str(data), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and line.startswith("train_bart.py: error: argument --data: ") and expected in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pairs.jsonl"]  # no run folder


def test_train_bart_takes_a_pairs_file_of_two_rows(tmp_path):
    train_bart = load_recipe("train_bart")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(PAIR) + "\n" + json.dumps({**PAIR, "source": "def sub(a, b)"}) + "\n")
    assert train_bart.seq2seq_data(str(data)) == str(data)
    assert (
        train_bart.MIN_DOCUMENTS
        == 2
        == min(documents for documents in range(1, 10) if documents - validation_count(documents) >= 1)
    )


def validation_count(documents: int) -> int:
    from damcha_hf.data import validation_document_count

    return validation_document_count(documents, 0.05)


def test_train_diffusion_refuses_a_feature_classifier_that_is_no_vit_classifier(tmp_path):
    pytest.importorskip("diffusers")
    images = tmp_path / "images"
    for label in ("a", "b"):
        (images / label).mkdir(parents=True)
        for index in range(2):
            Image.new("L", (16, 16), color=60 * index).save(images / label / f"{index}.png")
    damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()).save_pretrained(tmp_path / "vit28")
    common = ["--data", str(images), "--image-size", "16", "--patch-size", "4", "--output-dir", str(tmp_path / "run")]
    before = files_under(tmp_path)
    for classifier, expected in (
        ("gpt2", "holds a 'damcha_gpt2' model (DamchaGPT2LMHeadModel); it must be a ViT image classifier checkpoint, "
                 "e.g. recipes/train_vit.py's final folder"),
        ("vit28", "takes 28-pixel images but the data here are 16-pixel"),
    ):  # fmt: skip
        code, line = run_recipe("train_diffusion.py", *common, "--feature-classifier", str(tmp_path / classifier))
        assert code == 2 and line.startswith(f"train_diffusion.py: error: --feature-classifier {tmp_path / classifier}")
        assert expected in line, line
    assert files_under(tmp_path) == before


# ------------------------------------------------------------------------------------------------- config fields


CONFIG_CLASSES = {
    "gpt2": damcha_hf.DamchaGPT2Config,
    "llama": damcha_hf.DamchaLlamaConfig,
    "vit": damcha_hf.DamchaViTConfig,
    "bart": damcha_hf.DamchaBartConfig,
    "vit_denoiser": damcha_hf.DamchaViTDenoiserConfig,
    "mistral": damcha_hf.DamchaMistralConfig,
    "qwen2": damcha_hf.DamchaQwen2Config,
    "qwen3": damcha_hf.DamchaQwen3Config,
    "phi3": damcha_hf.DamchaPhi3Config,
    "gemma2": damcha_hf.DamchaGemma2Config,
}
CHOICE_FIELDS = {
    "cross_head_variant": CROSS_HEAD_VARIANTS,
    "metric_context": METRIC_CONTEXTS,
    "metric_mask": METRIC_MASKS,
    "metric_sharing": ("stack", "layer"),
    "metric_form": METRIC_FORMS,
}
# (field, bad value, the allowed values in words, the fix): every DAMCHA field of every family, a wrong value and a
# value of the wrong type each.
FIELD_CASES = [
    *[(field, bad, ", ".join(map(repr, allowed)), "choose one of")
      for field, allowed in CHOICE_FIELDS.items() for bad in ("bogus", 5)],
    *[(field, bad, "a positive integer", suggestion)
      for field, suggestion in (("metric_hidden_size", "64 is a good default"), ("dcmha_rank", "2 is the paper's"))
      for bad in (0, "8", True, 2.0)],
]  # fmt: skip
FAMILY_FIELD_CASES = {
    "bart": [
        ("encoder_metric_context", "bogus", "'token', 'sequence', 'query', or None", "choose one of"),
        ("cross_attention_metric", 3, "'decoder', 'own', 'none'", "choose one of"),
    ],
    "vit_denoiser": [
        ("time_embedding_size", 15, "an even integer of at least 2", "256 is a good default"),
        ("time_embedding_size", "16", "an even integer of at least 2", "256 is a good default"),
        ("time_max_period", 1, "a number above 1", "10000 is the usual choice"),
        ("time_max_period", "1e4", "a number above 1", "10000 is the usual choice"),
    ],
}


@pytest.mark.parametrize(
    "family, field, bad, allowed, fix",
    [(family, *case) for family in CONFIG_CLASSES for case in (*FIELD_CASES, *FAMILY_FIELD_CASES.get(family, ()))],
)
def test_a_bad_config_field_is_a_one_line_value_error_naming_it(family, field, bad, allowed, fix):
    config_class = CONFIG_CLASSES[family]
    with pytest.raises(ValueError) as error:
        config_class(**{field: bad})
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{config_class.__name__}: ")
    assert f"`{field}`" in message and repr(bad) in message and allowed in message and fix in message, message
    config = config_class()  # set later: refused the same way, and the config keeps its value
    kept = getattr(config, field)
    with pytest.raises(ValueError) as later:
        setattr(config, field, bad)
    assert str(later.value) == message and getattr(config, field) == kept


@pytest.mark.parametrize("family", CONFIG_CLASSES)
def test_config_errors_across_fields_and_of_stock_fields_are_one_line_value_errors(family):
    config_class = CONFIG_CLASSES[family]
    width = {"gpt2": "n_embd", "bart": "d_model"}.get(family, "hidden_size")
    heads = {"gpt2": "n_head", "bart": "encoder_attention_heads"}.get(family, "num_attention_heads")
    # Llama's own check of the heads comes before DAMCHA's: either message names both numbers.
    cases = [({width: 30, heads: 4}, ("(30)", "(4)"))]
    if config_class.damcha_causal:
        cases.append(({"metric_context": "sequence"}, ("`metric_context='sequence'`", "use `metric_context='token'`")))
    stock_field = "image_size" if family in ("vit", "vit_denoiser") else "vocab_size"
    cases.append(({stock_field: "many"}, (stock_field, "'many'", "give")))
    for fields, expected in cases:
        if family == "bart" and width in fields:
            fields = {**fields, "decoder_attention_heads": 4}
        if hasattr(config_class(), "num_key_value_heads") and width in fields:  # a preset's 8 would not divide 4
            fields = {**fields, "num_key_value_heads": 4}
        if hasattr(config_class(), "head_dim") and width in fields:  # a head width of its own (Qwen3's 128) is free
            fields = {**fields, "head_dim": fields[width] // fields[heads]}  # the width split into heads, truncated
        with pytest.raises(ValueError) as error:
            config_class(**fields)
        assert "\n" not in str(error.value) and all(text in str(error.value) for text in expected), str(error.value)
    assert config_class(metric_mask="diagonal").metric_mask == "diagonal"  # good values pass


# ----------------------------------------------------------------------------------------- documented dotted names


def documented_dotted_names() -> list[str]:
    texts = [(REPO / "README.md").read_text(encoding="utf-8")]
    texts += [path.read_text(encoding="utf-8") for path in sorted((REPO / "docs").glob("*.md"))]
    return sorted({name for text in texts for name in re.findall(r"\bdamcha_hf(?:\.[A-Za-z_]\w*)+", text)})


def test_every_documented_dotted_name_resolves_after_a_plain_import():
    names = documented_dotted_names()
    assert "damcha_hf.hub.save_hub_checkpoint" in names and "damcha_hf.metrics.load_metric" in names
    script = (
        "import json, sys\n"
        "import damcha_hf\n"
        "eager = sorted(name for name in ('torch', 'transformers') if name in sys.modules)\n"
        "missing = []\n"
        "for dotted in json.loads(sys.argv[1]):\n"
        "    value = damcha_hf\n"
        "    try:\n"
        "        for part in dotted.split('.')[1:]:\n"
        "            value = getattr(value, part)\n"
        "    except AttributeError as error:\n"
        "        missing.append(f'{dotted}: {error}')\n"
        "print(json.dumps({'eager': eager, 'missing': missing}))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script, json.dumps(names)], capture_output=True, text=True,
                               timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    assert result["eager"] == []  # `import damcha_hf` itself imports neither torch nor transformers
    assert result["missing"] == []


def test_every_module_of_the_package_is_a_lazy_attribute():
    package = REPO / "damcha_hf"
    modules = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    modules |= {path.parent.name for path in package.glob("*/__init__.py")}
    assert set(damcha_hf.SUBMODULES) == modules | {"modeling"}
    assert set(damcha_hf.SUBMODULES) <= set(dir(damcha_hf))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        damcha_hf.no_such_module  # noqa: B018


@pytest.mark.parametrize("variant", CROSS_HEAD_VARIANTS)
def test_info_prints_every_label_apart_from_its_value_in_one_column(variant, capsys):
    """`moa_balance_loss_coef:0.01` ran a value into its label: every line is `label:` and at least one space, the
    values in one column, each variant field's value the preset config's own (the oracle: the config itself)."""
    from damcha_hf.families import presets

    assert cli_main(["info", "gpt2-small", "--cross-head-variant", variant]) == 0
    lines = capsys.readouterr().out.splitlines()
    parsed = [re.fullmatch(r"([^:\s][^:]*):( +)(\S.*)", line) for line in lines]
    assert all(parsed), lines
    columns = {len(match.group(1)) + 1 + len(match.group(2)) for match in parsed}
    assert len(columns) == 1, lines
    printed = {match.group(1): match.group(3) for match in parsed}
    config = presets()["gpt2-small"][1](cross_head_variant=variant)
    fields = ["cross_head_variant", *damcha_hf.modeling.variants.VARIANTS[variant].fields]
    assert all(printed[field] == str(getattr(config, field)) for field in fields), printed


def test_info_refuses_a_variant_for_a_checkpoint_folder_which_has_its_own(tmp_path, capsys):
    """`--cross-head-variant` picks a preset's variant; on a checkpoint folder it would be ignored without a word."""
    damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()).save_pretrained(tmp_path / "ck")
    capsys.readouterr()  # the save's progress bar
    assert cli_main(["info", str(tmp_path / "ck"), "--cross-head-variant", "moa"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--cross-head-variant applies to a preset; {tmp_path / 'ck'} is a checkpoint folder" in line
    assert cli_main(["info", str(tmp_path / "ck")]) == 0
    assert re.search(r"^cross_head_variant: +damcha$", capsys.readouterr().out, flags=re.MULTILINE)
