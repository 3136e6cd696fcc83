"""Every Python snippet of a model card runs as written: non-interactively (stdin closed, so transformers' "Do you wish
to run the custom code? [y/N]" prompt would fail the run), offline, with the checkpoint folder in place of the Hub id;
the "without the plugin" snippets in a fresh interpreter where `damcha_hf` cannot be imported."""

import contextlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    AUTO_IMAGE_PROCESSOR_USABLE,
    PYTHON_BLOCK,
    load_recipe,
    needs_auto_image_processor,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
    train_lora_adapter,
)

import damcha_hf
from damcha_hf import hub
from damcha_hf.data import NUM_BYTES, byte_level_tokenizer, train_bpe_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
# Runs each snippet file given on the command line in its own namespace; `damcha_hf` is made unimportable first when
# asked, and the source checkout is taken off the path, so only an installed plugin or the checkpoint's code can load.
SNIPPET_RUNNER = textwrap.dedent(
    """
    import sys

    without_plugin = sys.argv[1] == "without-plugin"
    if without_plugin:
        sys.modules["damcha_hf"] = None
        sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]
    for path in sys.argv[2:]:
        namespace = {{"__name__": "__main__"}}
        exec(compile(open(path).read(), path, "exec"), namespace)
        loaded = [type(value).__name__ for value in namespace.values() if hasattr(value, "from_pretrained")
                  or hasattr(value, "save_pretrained")]
        print(path, "OK", *loaded)
    """
)


def card_snippets(folder: Path) -> list[str]:
    """The card's Python code blocks, with the placeholder Hub id replaced by the checkpoint folder."""
    card = (folder / "README.md").read_text()
    blocks = PYTHON_BLOCK.findall(card)
    assert blocks, "the card has no Python snippet"
    return [block.replace(hub.REPO_PLACEHOLDER, str(folder)) for block in blocks]


def run_snippets(snippets: list[str], work_dir: Path, *, plugin: bool, cwd: Path | None = None) -> str:
    work_dir.mkdir(parents=True, exist_ok=True)
    runner = work_dir / "run_snippets.py"
    runner.write_text(SNIPPET_RUNNER.format(repo_root=str(REPO_ROOT)))
    files = []
    for index, snippet in enumerate(snippets):
        files.append(work_dir / f"snippet_{index}.py")
        files[-1].write_text(snippet)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(work_dir / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-I", str(runner), "with-plugin" if plugin else "without-plugin", *map(str, files)],
        check=False,
        cwd=cwd or work_dir,
        env=env,
        stdin=subprocess.DEVNULL,  # an interactive prompt reads EOF and fails instead of waiting
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr
    return completed.stdout


def run_quietly(code: str, work_dir: Path) -> str:
    """`code` where damcha_hf cannot be imported (as `run_snippets` without the plugin), stdin closed; its stdout,
    after checking that it printed nothing on stderr: no prompt, no warning."""
    work_dir.mkdir(parents=True, exist_ok=True)
    runner = work_dir / "run_snippets.py"
    runner.write_text(SNIPPET_RUNNER.format(repo_root=str(REPO_ROOT)))
    (work_dir / "code.py").write_text(code)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(work_dir / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-I", str(runner), "without-plugin", str(work_dir / "code.py")],
        cwd=work_dir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stderr == "", completed.stderr[-4000:]
    return completed.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """A DAMCHA GPT-2 with its tokenizer, its card naming the local folder it was saved in (`./gpt2`, from the
    fixture's root), and a DAMCHA ViT with its image processor, its card naming the placeholder Hub id."""
    from transformers import ViTImageProcessor

    root = tmp_path_factory.mktemp("cards")
    tokenizer = byte_level_tokenizer()
    language_model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(vocab_size=len(tokenizer)))
    with contextlib.chdir(root):
        hub.save_hub_checkpoint(language_model, "./gpt2", tokenizer_or_processor=tokenizer, local_folder="./gpt2")
    vision_model = damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config())
    processor = ViTImageProcessor(size={"height": 16, "width": 16})
    hub.save_hub_checkpoint(vision_model, root / "vit", tokenizer_or_processor=processor, heatmap_inputs=None)
    return [root / "gpt2", root / "vit"]


def test_every_card_snippet_runs_non_interactively_as_written(checkpoints, tmp_path):
    if not AUTO_IMAGE_PROCESSOR_USABLE:  # the ViT card's snippets load its image processor with AutoImageProcessor
        checkpoints = [folder for folder in checkpoints if folder.name != "vit"]
    gpt2_card = (checkpoints[0] / "README.md").read_text()
    assert hub.REPO_PLACEHOLDER not in gpt2_card and 'from_pretrained("./gpt2", trust_remote_code=True)' in gpt2_card
    with_plugin, without_plugin = [], []
    for folder in checkpoints:
        for snippet in card_snippets(folder):
            (with_plugin if "import damcha_hf" in snippet else without_plugin).append(snippet)
    assert len(with_plugin) == len(without_plugin) == len(checkpoints)

    # From the folder the GPT-2 was saved from, where its card's `./gpt2` points.
    root = checkpoints[0].parent
    printed = run_snippets(without_plugin, tmp_path / "without", plugin=False, cwd=root)
    # The model class came from the checkpoint's own code, and the tokenizer / image processor loaded too.
    assert printed.count(" OK ") == len(without_plugin)
    assert "DamchaGPT2LMHeadModel" in printed
    assert "TokenizersBackend" in printed or "Tokenizer" in printed
    if AUTO_IMAGE_PROCESSOR_USABLE:
        assert "DamchaViTForImageClassification" in printed and "ImageProcessor" in printed

    printed = run_snippets(with_plugin, tmp_path / "with", plugin=True, cwd=root)
    assert printed.count(" OK ") == len(with_plugin) and "DamchaGPT2LMHeadModel" in printed


def printed_block(printed: str, after: str, before: str) -> str:
    """The indented code the demo printed between the text `after` and the text `before`, dedented."""
    return textwrap.dedent(printed.split(after, 1)[1].split(before, 1)[0]).strip("\n") + "\n"


def test_the_demo_says_how_to_load_its_checkpoint_and_its_card_names_the_folder_until_pushed(
    tmp_path, monkeypatch, capsys
):
    """A tiny `damcha-hf demo` run from a user's folder: the lines it prints to load the checkpoint, with the plugin and
    without it, and its card's snippets, which name `./damcha-demo` (not a placeholder id), all run as written from
    that folder; a push writes the repository id in the folder's place and drops the sentence about it."""
    from damcha_hf.cli import main

    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(200)))
    assert main(["demo", "--data", "corpus.txt", "--max-steps", "4", "--time-budget", "0", "--n-layer", "1",
                 "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "8", "--metric-hidden-size",
                 "8", "--eval-blocks", "8", "--sample-tokens", "4", "--no-progress", "--num-threads", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "saved the DAMCHA model to ./damcha-demo" in printed
    with_plugin = printed_block(printed, "load it with the plugin:", "\n\nor without it")
    without_plugin = printed_block(printed, "subfolder without remote code):", "\n\n(the model card")
    assert with_plugin.startswith("import damcha_hf") and 'AutoModelForCausalLM.from_pretrained("./damcha-demo")' in (
        with_plugin
    )
    assert 'from_pretrained("./damcha-demo", trust_remote_code=True)' in without_plugin
    assert 'AutoTokenizer.from_pretrained("./damcha-demo", subfolder="tokenizer")' in without_plugin

    card = Path("damcha-demo/README.md").read_text()
    assert hub.REPO_PLACEHOLDER not in card and "your-name" not in card
    blocks = PYTHON_BLOCK.findall(card)
    assert blocks == [with_plugin, without_plugin]  # the card's snippets are the printed ones
    printed = run_snippets([without_plugin], tmp_path / "without", plugin=False, cwd=tmp_path)
    assert "DamchaGPT2LMHeadModel" in printed and "Tokenizer" in printed
    printed = run_snippets([with_plugin], tmp_path / "with", plugin=True, cwd=tmp_path)
    assert "DamchaGPT2LMHeadModel" in printed

    pushed = hub.model_card.card_for_repository(card, "someone/damcha-demo")
    assert "./damcha-demo" not in pushed and "local folder" not in pushed and "These snippets load" not in pushed
    assert PYTHON_BLOCK.findall(pushed) == [
        block.replace('"./damcha-demo"', '"someone/damcha-demo"') for block in blocks
    ]


TOKENIZER_SAMPLES = ["def f(x):\n    return x  # naïve café, 日本", "<|endoftext|>two documents<|endoftext|>", " a"]
TEST_IMAGE = np.arange(20 * 24 * 3, dtype=np.uint8).reshape(20, 24, 3)


def tokenizer_behaviour(tokenizer) -> dict:
    """What a user of a tokenizer meets: the ids of the samples, their decoding, padding, truncation at the model's
    context and the special tokens."""
    ids = [tokenizer(text)["input_ids"] for text in TOKENIZER_SAMPLES]
    return {
        "ids": ids,
        "decoded": [tokenizer.decode(sample) for sample in ids],
        "padded": tokenizer(TOKENIZER_SAMPLES, padding=True)["input_ids"],
        "truncated": len(tokenizer("x" * 1000, truncation=True)["input_ids"]),
        "model_max_length": tokenizer.model_max_length,
        "special": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token],
        "length": len(tokenizer),
    }


@pytest.fixture(scope="module")
def preprocessed_checkpoints(tmp_path_factory):
    """DAMCHA checkpoints as the recipes and the demo write them, with the tokenizer or image processor they were
    saved with: a GPT-2 with a trained BPE tokenizer, a Llama with the byte-level one, a ViT with an image processor."""
    from transformers import ViTImageProcessor

    root = tmp_path_factory.mktemp("preprocessors")
    corpus = [f"def line_{index}(x):\n    return x * {index}  # café\n" for index in range(200)]
    bpe, byte_level = train_bpe_tokenizer(corpus, NUM_BYTES + 40), byte_level_tokenizer()
    end_of_text = byte_level.convert_tokens_to_ids(byte_level.eos_token)
    models = {
        "gpt2": (damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(vocab_size=len(bpe))), bpe),
        "llama": (
            damcha_hf.DamchaLlamaForCausalLM(
                tiny_damcha_llama_config(
                    vocab_size=len(byte_level),
                    bos_token_id=end_of_text,
                    eos_token_id=end_of_text,
                    pad_token_id=end_of_text,
                )  # fmt: skip
            ),
            byte_level,
        ),
        "vit": (
            damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()),
            ViTImageProcessor(size={"height": 28, "width": 28}),
        ),
    }
    return {
        name: (
            hub.save_hub_checkpoint(model, root / name, tokenizer_or_processor=preprocessor, metric_heatmap=False),
            model,
            preprocessor,
        )  # fmt: skip
        for name, (model, preprocessor) in models.items()
    }


@needs_auto_image_processor
def test_auto_tokenizer_and_image_processor_load_quietly_without_the_plugin(preprocessed_checkpoints, tmp_path):
    """Where damcha_hf cannot be imported, stdin closed: `AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")`
    and `AutoImageProcessor.from_pretrained(folder)`, as the card says, load without trust_remote_code, a prompt, a
    Python warning or a transformers log line, and give what the saved tokenizer and processor give. From the top
    folder `AutoTokenizer` reads config.json, and stops at the remote-code prompt (the reason for the subfolder)."""
    from PIL import Image

    text = {name: str(preprocessed_checkpoints[name][0]) for name in ("gpt2", "llama")}
    vit = preprocessed_checkpoints["vit"][0]
    np.save(tmp_path / "image.npy", TEST_IMAGE)
    code = inspect.getsource(tokenizer_behaviour) + textwrap.dedent(
        f"""
        import contextlib, io, json, logging, warnings
        import numpy as np
        from PIL import Image
        from transformers import AutoImageProcessor, AutoTokenizer

        TOKENIZER_SAMPLES = {TOKENIZER_SAMPLES!r}
        logged = []
        collector = logging.Handler(logging.DEBUG)
        collector.emit = lambda record: logged.append(record.getMessage()) if record.levelno >= logging.WARNING else None
        logging.getLogger("transformers").addHandler(collector)
        results = {{}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, folder in {text!r}.items():
                tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
                results[name] = tokenizer_behaviour(tokenizer)
            processor = AutoImageProcessor.from_pretrained({str(vit)!r})
            image = Image.fromarray(np.load({str(tmp_path / "image.npy")!r}))
            results["vit"] = processor(image, return_tensors="np")["pixel_values"].tolist()
        print("RESULTS", json.dumps({{"results": results, "warnings": [str(w.message) for w in caught],
                                      "logged": logged}}))

        # The top folder, for contrast: the prompt's text goes to stdout, which is kept apart here.
        prompt = io.StringIO()
        logging.getLogger("transformers").handlers[0].setLevel(logging.CRITICAL)
        with contextlib.redirect_stdout(prompt):
            AutoTokenizer.from_pretrained({text["gpt2"]!r})
        print("TOP FOLDER PROMPTS", "Do you wish to run the custom code" in prompt.getvalue())
        """
    )
    printed = run_quietly(code, tmp_path)
    assert "Do you wish to run the custom code" not in printed
    assert "TOP FOLDER PROMPTS True" in printed
    report = json.loads(printed.split("RESULTS ", 1)[1].splitlines()[0])
    assert report["warnings"] == [] and report["logged"] == []
    for name in ("gpt2", "llama"):
        folder, model, tokenizer = preprocessed_checkpoints[name]
        expected = tokenizer_behaviour(tokenizer)
        assert expected["model_max_length"] != model.config.max_position_embeddings  # the save fitted it
        expected.update(model_max_length=model.config.max_position_embeddings,
                        truncated=model.config.max_position_embeddings)  # fmt: skip
        assert report["results"][name] == expected
        assert report["results"][name]["decoded"] == TOKENIZER_SAMPLES  # byte-level: every text round-trips
    _, _, processor = preprocessed_checkpoints["vit"]
    expected_pixels = processor(Image.fromarray(TEST_IMAGE), return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(np.array(report["results"]["vit"]), expected_pixels, rtol=0, atol=1e-6)

    # The card says the same, and its lines load quietly (the card test above runs them as written).
    for name in ("gpt2", "llama", "vit"):
        folder = preprocessed_checkpoints[name][0]
        without_plugin = [snippet for snippet in card_snippets(folder) if "import damcha_hf" not in snippet]
        assert len(without_plugin) == 1
        loading = without_plugin[0].split("processor =" if name == "vit" else "tokenizer =", 1)[1]
        assert "trust_remote_code" not in loading
        if name == "vit":
            assert loading.startswith(f' AutoImageProcessor.from_pretrained("{folder}")')
        else:
            assert loading.startswith(f' AutoTokenizer.from_pretrained("{folder}", subfolder="tokenizer")')


def assert_no_absolute_paths(folder: Path, *paths: Path) -> None:
    """No file of `folder` (config, card, tokenizer, weights) names any of `paths` or the home folder."""
    markers = {str(Path.home())} | {str(path.absolute()) for path in paths} | {str(path.resolve()) for path in paths}
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    assert any(path.name == "adapter_config.json" for path in files)
    for path in files:
        content = path.read_bytes()
        for marker in markers:
            assert marker.encode() not in content, f"{path.name} contains the local path {marker}"


@pytest.mark.slow  # about 25 s: a LoRA run and two fresh interpreters
def test_a_lora_adapter_reloads_with_plain_peft_without_the_plugin(tmp_path, monkeypatch):
    """`AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)`, as the adapter's card says, run
    from the folder training ran in, and `PeftModel.from_pretrained(base, adapter)` give the trained model: the same
    logits as the merged checkpoint the recipe writes. No file of the adapter names an absolute path of the machine."""
    import json

    from transformers import AutoModelForCausalLM

    recipe = load_recipe("finetune_lora")
    monkeypatch.chdir(tmp_path)  # the user's folder: the run goes to ./run, as the recipe's relative default does
    tokenizer = train_lora_adapter(recipe, tmp_path, "run")
    run = tmp_path / "run"
    adapter = run / "adapter"
    card = (adapter / "README.md").read_text()
    assert "AutoPeftModelForCausalLM" in card and "[More Information Needed]" not in card
    # PEFT resolves a relative base against the folder it is loaded from: here, the folder training ran in.
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "run/base"
    assert_no_absolute_paths(adapter, tmp_path, run)

    input_ids = torch.tensor([tokenizer("line 7 of a small")["input_ids"]])
    merged = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    with torch.no_grad():
        expected = merged(input_ids=input_ids).logits
    torch.save(input_ids, tmp_path / "input_ids.pt")
    snippets = [
        block.replace(recipe.ADAPTER_PLACEHOLDER, "run/adapter").replace(recipe.BASE_PLACEHOLDER, str(run / "base"))
        for block in PYTHON_BLOCK.findall(card)
    ]
    assert len(snippets) == 2 and "AutoPeftModelForCausalLM" in snippets[0] and "PeftModel." in snippets[1]
    for index, snippet in enumerate(snippets):
        check = textwrap.dedent(
            f"""
            import torch
            with torch.no_grad():
                logits = model.eval()(input_ids=torch.load({str(tmp_path / "input_ids.pt")!r})).logits
            torch.save(logits, {str(tmp_path / f"logits_{index}.pt")!r})
            print(type(model.get_base_model()).__module__)
            """
        )
        printed = run_snippets([snippet + check], tmp_path / f"without_{index}", plugin=False, cwd=tmp_path)
        assert "transformers_modules" in printed  # the base model's class came from its own code, not the plugin
        torch.testing.assert_close(torch.load(tmp_path / f"logits_{index}.pt"), expected, rtol=1e-4, atol=1e-5)


def test_a_lora_adapter_outside_the_current_folder_names_its_base_without_absolute_paths(tmp_path, monkeypatch):
    """A run folder given as an absolute path outside the current folder: the adapter names its base by the Hub id
    given (`--base-model-id`, also the card's `base_model`), or as `../base` beside the adapter, never by the run
    folder's absolute path; a local path as --base-model-id is refused while parsing."""
    import json

    recipe = load_recipe("finetune_lora")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for local_or_bare in (str(tmp_path / "base"), "damcha-gpt2-base"):  # a bare name lands in the owner's namespace
        with pytest.raises(SystemExit) as refused:
            recipe.parse_args(["--base", str(tmp_path), "--base-model-id", local_or_bare])
        assert refused.value.code == 2

    runs = {"hub": tmp_path / "runs" / "with-id", "local": tmp_path / "runs" / "without-id"}
    train_lora_adapter(recipe, tmp_path, str(runs["hub"]), "--base-model-id", "your-name/damcha-gpt2-base")
    adapter = runs["hub"] / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "your-name/damcha-gpt2-base"
    )
    card = (adapter / "README.md").read_text()
    assert "\nbase_model: your-name/damcha-gpt2-base\n" in card
    assert 'from_pretrained("your-name/damcha-gpt2-base", trust_remote_code=True)' in card  # not path/to/base
    assert_no_absolute_paths(adapter, tmp_path, runs["hub"], elsewhere)

    train_lora_adapter(recipe, tmp_path, str(runs["local"]))
    adapter = runs["local"] / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "../base"
    assert (adapter / config["base_model_name_or_path"] / "config.json").is_file()  # it names the saved base
    assert_no_absolute_paths(adapter, tmp_path, runs["local"], elsewhere)


def test_a_stock_baseline_gets_its_own_pipeline_tag_and_no_damcha_claims(tmp_path):
    """The MHA baseline a recipe trains (`train_gpt2.py --model-type gpt2 / llama`, a stock ViT) is a stock
    transformers model: its card carries the pipeline tag of its head as transformers' own pipelines name it
    (a causal LM generates text, a ViT classifier classifies images), no DAMCHA tag, setting or citation, no remote
    code; its snippet loads it with transformers' own class in a process without the plugin."""
    from huggingface_hub import ModelCard
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
        ViTImageProcessor,
    )
    from transformers.pipelines import SUPPORTED_TASKS

    tokenizer = byte_level_tokenizer()
    models = {
        "gpt2": (GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1,
                                            n_head=4)), tokenizer),
        "llama": (LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)),
                  tokenizer),
        "vit": (ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=4, intermediate_size=64, num_labels=3)),
                ViTImageProcessor(size={"height": 16, "width": 16})),
    }  # fmt: skip
    if not AUTO_IMAGE_PROCESSOR_USABLE:  # the ViT card's snippet loads its image processor with AutoImageProcessor
        del models["vit"]
    snippets = []
    for name, (model, processor) in models.items():
        folder = hub.save_hub_checkpoint(model, tmp_path / name, tokenizer_or_processor=processor)
        card = ModelCard.load(folder / "README.md")
        # The oracle: the tasks whose transformers pipeline loads this model class through its Auto class.
        config_class, tasks = type(model.config), set()
        for task, spec in SUPPORTED_TASKS.items():
            for auto in spec["pt"]:
                mapping = getattr(auto, "_model_mapping", None)
                if mapping is not None and config_class in mapping and mapping[config_class] is type(model):
                    tasks.add(task)
        assert card.data.pipeline_tag in tasks
        assert card.data.pipeline_tag == ("image-classification" if name == "vit" else "text-generation")
        assert card.data.tags == [name]
        # (The snippets' placeholder id is replaced by the real one on push.)
        text = card.text.replace(hub.REPO_PLACEHOLDER, "").lower()
        assert "damcha" not in text.replace("damcha-hf", "").replace("damcha models", "")
        assert "trust_remote_code" not in card.text and not list(folder.glob("*.py"))
        snippets += card_snippets(folder)
    assert len(snippets) == len(models)
    printed = run_snippets(snippets, tmp_path / "without", plugin=False)
    assert printed.count(" OK ") == len(models)
    assert "GPT2LMHeadModel" in printed and "LlamaForCausalLM" in printed
    assert ("ViTForImageClassification" in printed) == AUTO_IMAGE_PROCESSOR_USABLE
