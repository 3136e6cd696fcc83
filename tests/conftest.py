"""Shared test setup and helpers: offline, deterministic, tiny random configs, generated data sets, recipe runs, the
fresh-interpreter checkpoint loader and a fake Hub. Test modules import these from here, never from each other."""

import gzip
import inspect
import json
import os
import random
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers 5.25 loads attention kernels from the Hub through the `kernels` package unless told not to; where that
# package is absent (5.25 installed with --no-deps, see docs/tested-range.md) every from_pretrained would raise
# "Kernels are not available". The tests use no Hub kernels on any version.
os.environ.setdefault("USE_HUB_KERNELS", "0")

import huggingface_hub  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from huggingface_hub import HfApi  # noqa: E402
from transformers import BartConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, ViTConfig  # noqa: E402

import damcha_hf  # noqa: E402,F401  (registers the Auto classes)
from damcha_hf import data_sources  # noqa: E402
from damcha_hf.data import byte_level_tokenizer  # noqa: E402
from damcha_hf.families import family_of  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

# Stand-ins for modules transformers' sdist lacks: imported by the common tests (upstream_common_tests.py), not run.
collect_ignore = ["upstream_stand_ins"]
COMMON_TESTS_FILE = "test_common_models.py"


def pytest_ignore_collect(collection_path, config):
    """Leave transformers' common tests uncollected when the `-m` selection excludes them: importing that file
    downloads transformers' sdist on first use, which a run of the default suite must not need."""
    if collection_path.name != COMMON_TESTS_FILE or not config.option.markexpr:
        return None
    from _pytest.mark.expression import Expression  # pytest's own `-m` parser

    selects_common = Expression.compile(config.option.markexpr).evaluate(lambda name, **kwargs: name == "common")
    return True if not selects_common else None


# The keyword under which the installed transformers passes the KV cache to a model (`past_key_values` up to 5.23,
# `cache` from 5.24 on), so that the tests run on every version the package supports.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(GPT2LMHeadModel.forward).parameters else "past_key_values"


def enable_activation_checkpointing(model, use_reentrant: bool | None = None) -> None:
    """Turn on activation (gradient) checkpointing by the installed transformers' name for it: recent releases call
    it `activation_checkpointing_enable` (and deprecate `gradient_checkpointing_enable`), 5.16 to 5.22 have only the
    older name, whose keyword for the checkpoint function's options is `gradient_checkpointing_kwargs`."""
    options = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(**({"activation_checkpointing_kwargs": options} if options else {}))
    else:
        model.gradient_checkpointing_enable(**({"gradient_checkpointing_kwargs": options} if options else {}))


def disable_activation_checkpointing(model) -> None:
    """Turn activation checkpointing off, by the installed release's name for it (see the above)."""
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def _auto_image_processor_usable() -> bool:
    """transformers 5.16 offers `AutoImageProcessor` only with torchvision installed (without it, a placeholder that
    raises ImportError on use, for stock ViT as for DAMCHA's); later releases fall back to the PIL processors."""
    from transformers import AutoImageProcessor

    try:
        AutoImageProcessor.from_pretrained  # noqa: B018  (the placeholder raises on attribute access)
    except ImportError:
        return False
    return True


AUTO_IMAGE_PROCESSOR_USABLE = _auto_image_processor_usable()
needs_auto_image_processor = pytest.mark.skipif(
    not AUTO_IMAGE_PROCESSOR_USABLE,
    reason="this transformers release offers AutoImageProcessor only with torchvision, which is not installed "
    "(stock ViT cannot load its image processor here either)",
)


TINY_GPT2 = dict(
    vocab_size=97,
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def tiny_token_ids(batch=2, seq=9, seed=0, lowest=3) -> torch.Tensor:
    """Token ids in lowest..96 of the tiny models' vocabulary of 97, the same for the same seed. The default 3 keeps
    clear of every tiny config's special tokens (pad 0 or 1, bos, eos 2); 1 draws from all but token 0."""
    return torch.randint(lowest, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


def float64_variant_lm(variant: str, **overrides) -> "damcha_hf.DamchaGPT2LMHeadModel":
    """A tiny DAMCHA GPT-2 of `cross_head_variant=variant` in float64 and eval mode, for the variants' oracle tests."""
    config = damcha_hf.DamchaGPT2Config(**{**TINY_GPT2, "cross_head_variant": variant, **overrides})
    return damcha_hf.DamchaGPT2LMHeadModel(config).double().eval()


def tiny_gpt2_config(**overrides) -> GPT2Config:
    return GPT2Config(**{**TINY_GPT2, **overrides})


def tiny_damcha_gpt2_config(**overrides) -> damcha_hf.DamchaGPT2Config:
    return damcha_hf.DamchaGPT2Config(**{**TINY_GPT2, "metric_hidden_size": 16, **overrides})


TINY_VIT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": 28,
    "patch_size": 4,
    "num_channels": 1,
    "num_labels": 3,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def tiny_vit_config(**overrides) -> ViTConfig:
    return ViTConfig(**{**TINY_VIT, **overrides})


def tiny_damcha_vit_config(**overrides) -> damcha_hf.DamchaViTConfig:
    return damcha_hf.DamchaViTConfig(**{**TINY_VIT, "metric_hidden_size": 16, **overrides})


# 8 query heads of width 8; `num_key_value_heads` 2 (grouped-query, the default here) or 8 (multi-head).
TINY_LLAMA = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_damcha_llama_config(**overrides) -> damcha_hf.DamchaLlamaConfig:
    return damcha_hf.DamchaLlamaConfig(**{**TINY_LLAMA, "metric_hidden_size": 16, **overrides})


# 4 heads of width 8 in each stack; token 2 ends a sequence and starts the decoder, 1 pads.
TINY_BART = {
    "vocab_size": 97,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "pad_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
    "forced_eos_token_id": None,
    "dropout": 0.0,
    "init_std": 0.1,  # attention maps peaked enough that mixing them shows in the logits
}


def tiny_bart_config(**overrides) -> BartConfig:
    return BartConfig(**{**TINY_BART, **overrides})


def randomize_cross_head(model: torch.nn.Module, scale: float = 0.5, seed: int = 0) -> None:
    """Move every cross-head parameter of any variant off its MHA start, as training would: DAMCHA's generators (so
    that `C` is a random non-identity matrix), the talking-heads matrices and DCMHA's projections (identity-initialised
    matrices get identity + noise, the others noise of standard deviation `scale`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "cross_head_" not in name:
                continue
            noise = torch.randn(parameter.shape, generator=generator) * scale
            if name.endswith(("logits_projection", "weights_projection", "base_projection")):
                noise = noise + torch.eye(parameter.shape[-1])
            parameter.copy_(noise)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- the Debian data sets, as small generated samples in their on-disk formats -----------------------------------
# Tests never read /usr/share/datasets/fashion-mnist or /usr/share/dictd/gcide.dict.dz: the code under test is pointed
# at these (--fashion-mnist-dir, $DAMCHA_GCIDE_PATH) instead.


def write_idx(path, array) -> None:
    """`array` as a gzipped idx file (the MNIST format: two zero bytes, 0x08 for unsigned bytes, the number of
    dimensions, each size as a big-endian 32-bit integer, then the bytes)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + np.asarray(array).astype(np.uint8).tobytes())


def write_fashion_mnist(folder, train: int = 60, test: int = 20, seed: int = 0) -> str:
    """A folder laid out as Debian's dataset-fashion-mnist installs Fashion-MNIST (train-images-idx3-ubyte.gz,
    train-labels-idx1-ubyte.gz and the t10k-* pair), holding `train` and `test` random 28x28 images, labels 0-9."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, count in (("train", train), ("t10k", test)):
        write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"), rng.integers(0, 256, (count, 28, 28)))
        write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"), rng.integers(0, 10, count))
    return str(folder)


def write_gcide(path, size: int = 50_000, seed: int = 0) -> str:
    """A dictionary of at least `size` bytes as dictd stores GCIDE (`gcide.dict.dz`, gzip-compatible): one entry a
    line, a headword and a definition of words drawn from a random vocabulary."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(500)]
    blocks, written = [], 0
    while written < size:
        words = rng.choices(vocabulary, k=4000)
        block = "".join(f"{words[i].capitalize()}, n. {' '.join(words[i + 1 : i + 10])}.\n" for i in range(0, 4000, 10))
        blocks.append(block)
        written += len(block)
    with gzip.open(path, "wb", compresslevel=1) as handle:
        handle.write("".join(blocks).encode())
    return str(path)


def write_rows(path, rows: list[dict]) -> str:
    """`rows` written as the data file `path` names by its extension, the way people hand data to `datasets`: .parquet
    (pyarrow), .jsonl / .json (one object a line), .csv (a header, then the rows), .txt (the `text` field, a line
    each)."""
    import csv
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(path)
    if path.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.endswith((".jsonl", ".json")):
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    elif path.endswith(".csv"):
        with open(path, "w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.endswith(".txt"):
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(row["text"] + "\n" for row in rows)
    else:
        raise ValueError(f"write_rows: no writer for {path}")
    return path


def word_documents(count: int, *, seed: int = 0, words: int = 12) -> list[str]:
    """`count` short documents of random words, the same for the same seed."""
    vocabulary = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs", "far"]
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def png_bytes(pixels: np.ndarray) -> bytes:
    """A PNG file's bytes of a uint8 array (height x width: grayscale; height x width x 3: RGB)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_rows(count: int, *, size: int = 8, classes=("dark", "light"), seed: int = 0) -> list[dict]:
    """`count` rows of {"img": {"bytes": PNG}, "kind": class name}: dark and light noise images, a task a model can
    learn; in the layout `datasets` writes an `Image` column to parquet."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(count):
        kind = index % len(classes)
        base = 40 + 160 * kind
        pixels = np.clip(base + rng.integers(-30, 30, (size, size)), 0, 255).astype(np.uint8)
        rows.append({"img": {"bytes": png_bytes(pixels), "path": None}, "kind": classes[kind]})
    return rows


# --- the recipes, their runs and the folders they write -------------------------------------------------------------


REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_FOLDER = str(REPO_ROOT / "recipes")


def load_recipe(name: str):
    """A recipe script (`recipes/<name>.py`) imported as a module, its helper modules importable beside it."""
    import importlib.util

    if RECIPES_FOLDER not in sys.path:
        sys.path.insert(0, RECIPES_FOLDER)
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES_FOLDER, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A recipe run of a tiny GPT-2 small enough for a test; with `--metric-hidden-size` (TINY_GPT2_ARGS) the run is
# DAMCHA only, without it (TINY_RECIPE_ARGS) the flags suit stock and DAMCHA models alike.
TINY_GPT2_ARGS = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "8",
                  "--metric-hidden-size", "8", "--learning-rate", "3e-3", "--logging-steps", "1",
                  "--max-eval-samples", "16", "--num-threads", "1"]  # fmt: skip

TINY_RECIPE_ARGS = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "8",
                    "--learning-rate", "3e-3", "--logging-steps", "1", "--max-eval-samples", "8", "--num-threads", "1"]  # fmt: skip

# The recipes that write an output folder, for the tests of what they do with one already there.
RECIPE_NAMES = ("train_gpt2", "train_gpt2_accelerate", "train_vit", "finetune_lora")

# Bytes a user keeps in a folder: no test may lose them.
USER_BYTES = b"my thesis, chapter 3 \x00\xff (no backup)"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A 400-line text file of random words from a small vocabulary, for the recipes to train on."""
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs", "far", "away"]
    lines = [" ".join(rng.choice(words, 12)) + "\n" for _ in range(400)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(lines))
    return str(path)


def losses(log_history) -> dict[int, float]:
    """The training loss at each logged step of a Trainer log history."""
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


def assert_loss_goes_down(step_losses: dict[int, float]) -> None:
    """The mean of the last two logged losses is below the mean of the first two."""
    values = [step_losses[step] for step in sorted(step_losses)]
    assert np.mean(values[-2:]) < np.mean(values[:2]), values


def trainer_state(folder) -> dict:
    return json.loads((Path(folder) / "trainer_state.json").read_text())


def tiny_lm(**overrides):
    """A tiny DAMCHA GPT-2 in eval mode, its cross-head parameters moved off their MHA start."""
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(**overrides)).eval()
    randomize_cross_head(model, scale=0.3)
    return model


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes: compare two to see that nothing changed."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_error_line(captured: str) -> str:
    """The one non-blank line of `captured`, asserting there is exactly one and no traceback."""
    lines = [line for line in captured.splitlines() if line.strip()]
    assert len(lines) == 1, captured
    assert "Traceback" not in captured
    return lines[0]


def dead_pid() -> int:
    """The id of a process that has ended (what a killed save leaves in its temporary names)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def train_lora_adapter(recipe, folder: Path, output_dir: str, *extra: str):
    """A tiny stock GPT-2 in `folder/gpt2`, a corpus, and three LoRA steps on them into `output_dir`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = byte_level_tokenizer()
    base = folder / "gpt2"
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(f"line {index} of a small corpus for the adapter\n" for index in range(200)))
    recipe.main(["--base", str(base), "--data", str(corpus), "--output-dir", output_dir, "--max-steps", "3",
                 "--block-size", "32", "--batch-size", "4", "--metric-hidden-size", "8", "--learning-rate", "1e-2",
                 "--max-eval-samples", "4", "--num-threads", "1", "--merge", *extra])  # fmt: skip
    return tokenizer


# A fenced Python block of a model card or a Markdown file.
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


# --- loading a checkpoint in a fresh interpreter without the plugin ---------------------------------------------

# Runs in a fresh interpreter (`python -I`: no PYTHONPATH, no cwd on the path) with the plugin made unimportable, so
# that only the files copied next to the weights can define the model.
FRESH_PROCESS_LOADER = textwrap.dedent(
    """
    import sys

    sys.modules["damcha_hf"] = None  # `import damcha_hf` (and its submodules) now raises ImportError
    sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]  # no source checkout

    import torch
    import transformers

    spec_file, output_file = sys.argv[1:]
    reports = []
    for folder, inputs, auto_class_names in torch.load(spec_file):
        report = {{"classes": {{}}}}
        for index, auto_class_name in enumerate(auto_class_names):
            model = getattr(transformers, auto_class_name).from_pretrained(folder, trust_remote_code=True)
            report["classes"][auto_class_name] = (type(model).__module__, type(model).__name__)
            if index == 0:
                model.eval()
                with torch.no_grad():
                    report["logits"] = model(**inputs)[0]  # the logits (a denoiser: the predicted noise)
        reports.append(report)
    try:
        import damcha_hf  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    plugin_modules = sorted(m for m in sys.modules if m.startswith("damcha_hf") and sys.modules[m])
    for report in reports:
        report.update(damcha_hf_importable=importable, plugin_modules=plugin_modules)
    torch.save(reports, output_file)
    """
)


def load_in_fresh_process(folder: Path, inputs: dict, auto_class_names: list[str], work_dir: Path) -> dict:
    """Load `folder` with each Auto class and `trust_remote_code=True` in a new interpreter without the plugin.

    Returns the loaded class of each Auto class, the first one's logits on `inputs`, and whether damcha_hf was
    importable there. HF_HOME and the dynamic-module cache live in `work_dir`, and the Hub is offline.
    """
    (report,) = load_checkpoints_in_fresh_process([(folder, inputs, auto_class_names)], work_dir)
    return report


def load_checkpoints_in_fresh_process(checkpoints: list[tuple[Path, dict, list[str]]], work_dir: Path) -> list[dict]:
    """`load_in_fresh_process` for several (folder, inputs, Auto class names), in one new interpreter."""
    work_dir.mkdir(parents=True, exist_ok=True)
    script = work_dir / "load_without_plugin.py"
    script.write_text(FRESH_PROCESS_LOADER.format(repo_root=str(REPO_ROOT)))
    spec_file, output_file = work_dir / "checkpoints.pt", work_dir / "reports.pt"
    torch.save([(str(folder), inputs, list(names)) for folder, inputs, names in checkpoints], spec_file)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(
        HF_HOME=str(work_dir / "hf_home"),
        HF_MODULES_CACHE=str(work_dir / "hf_modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # The same thread count as this process, so that the CPU kernels reduce in the same order: identical logits.
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    completed = subprocess.run(
        [sys.executable, "-I", str(script), str(spec_file), str(output_file)],
        check=False,
        cwd=work_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return torch.load(output_file)


def expected_auto_map(config_class) -> dict[str, str]:
    """The `auto_map` a checkpoint of this family must carry: every head of its declaration, by file name."""

    def reference(cls) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    auto_map = {"AutoConfig": reference(config_class)}
    heads = [head for head in family_of(config_class).heads if head.auto_class]  # DoubleHeads has no Auto class
    auto_map.update({head.auto_class: reference(head.model_class) for head in heads})
    return auto_map


# --- the Hub, faked at HfApi ------------------------------------------------------------------------------------


class FakeHub:
    """Stands in for the Hub behind `HfApi`: records every call, writes committed files into a local folder."""

    USER = "token-owner"

    def __init__(self, root: Path):
        self.root, self.calls = root, []

    def install(self, monkeypatch):
        hub_ = self

        def create_repo(self, repo_id, *, private=False, exist_ok=False, repo_type=None, **kwargs):
            hub_.calls.append(("create_repo", repo_id, {"private": private, "exist_ok": exist_ok, "token": self.token}))
            # As the Hub does, a bare name is created in the token owner's namespace and returned in full.
            return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"{FakeHub.USER}/{repo_id}")

        def create_branch(self, repo_id, *, branch, exist_ok=False, repo_type=None, **kwargs):
            hub_.calls.append(("create_branch", repo_id, {"branch": branch}))

        def create_commit(self, repo_id, operations, *, commit_message, revision=None, repo_type=None, **kwargs):
            hub_.calls.append(
                ("create_commit", repo_id, {"revision": revision, "files": sorted(o.path_in_repo for o in operations)})
            )
            for operation in operations:
                target = hub_.root / repo_id / (revision or "main") / operation.path_in_repo
                target.parent.mkdir(parents=True, exist_ok=True)
                with operation.as_file() as handle:
                    target.write_bytes(handle.read())
            return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/fake")

        def refuse(self, *args, **kwargs):
            raise AssertionError("an unexpected HfApi call")

        for name in ("upload_folder", "upload_file", "repo_info", "list_repo_files", "preupload_lfs_files", "whoami"):
            monkeypatch.setattr(HfApi, name, refuse)
        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)
        return self


@pytest.fixture
def online(monkeypatch):
    """The Hub reachable as far as huggingface_hub and transformers can tell (tests fake the network itself)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


# --- what reaches an attention layer's **kwargs -----------------------------------------------------------------


def unread_keyword_arguments(monkeypatch, attention_class) -> set[str]:
    """Record the names that reach `**kwargs` of `attention_class.forward` (arguments it does not name)."""
    forward = attention_class.forward
    signature = inspect.signature(forward)
    var_keyword = next(name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD)
    unread = set()

    def recording_forward(self, *args, **kwargs):
        unread.update(signature.bind(self, *args, **kwargs).arguments.get(var_keyword, {}))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(attention_class, "forward", recording_forward)
    return unread


# Arguments transformers hands every layer that an attention layer has no use for (the attention functions ignore
# them). Any other name reaching `**kwargs` is an argument transformers expects the layer to act on: the cache under
# a new name was one (5.23 `past_key_values` vs 5.24 `cache`), so a new one must fail here before it fails a user.
IGNORED_LAYER_ARGUMENTS = {"use_cache", "position_ids", "output_attentions", "output_hidden_states"}


# --- the README's quick-run table -------------------------------------------------------------------------------

README = REPO_ROOT / "README.md"


# | `python recipes/train_vit.py --max-steps 5` | Fashion-MNIST | 17 s | 0.9 GB | 0.5 |
QUICK_RUN_ROW = re.compile(
    r"^\| `(?P<command>python [^`]+)` \| (?P<needs>[^|]+?) \| (?P<time>[\d.]+) (?P<unit>s|min) \|[^|]*\| "
    r"(?P<load>[\d.]+) \|$",
    re.MULTILINE,
)
SECONDS = {"s": 1, "min": 60}


@dataclass(frozen=True)
class DataSet:
    """A Debian data set a quick run may need: its package, whether it is installed here, and how a run is pointed
    at a generated copy of it (arguments added to the command, environment variables set)."""

    package: str
    missing_here: Callable[[], bool]
    point_at_sample: Callable[[Path], tuple[list[str], dict]]  # folder -> (extra arguments, environment)


def _fashion_mnist_sample(folder: Path) -> tuple[list[str], dict]:
    # As many images as the quick runs read: quality.py's 500 test images, a few batches of training images.
    return ["--fashion-mnist-dir", write_fashion_mnist(folder / "fashion-mnist", train=2000, test=500)], {}


def _gcide_sample(folder: Path) -> tuple[list[str], dict]:
    # quality.py's LM task reads 12 MB (10 train, 1 validation, 1 test).
    return [], {data_sources.GCIDE_PATH_VARIABLE: write_gcide(folder / "gcide.dict.dz", size=12_200_000)}


DATA_SETS = {
    "Fashion-MNIST": DataSet(
        "dataset-fashion-mnist",
        lambda: data_sources.missing_fashion_mnist_message(data_sources.FASHION_MNIST_DIR) is not None,
        _fashion_mnist_sample,
    ),
    "GCIDE": DataSet("dict-gcide", lambda: data_sources.missing_gcide_message() is not None, _gcide_sample),
}
INSTALL_COMMAND = "apt-get update && apt-get install -y dataset-fashion-mnist dict-gcide"


# A quick run's need of a setup.cfg extra, as the table names it: "the `seq2seq` extra".
EXTRA = re.compile(r"^the `(?P<name>[\w-]+)` extra$")


@dataclass(frozen=True)
class QuickRun:
    command: str
    needs: tuple[str, ...]  # names of DATA_SETS
    stated_seconds: float
    measured_load: float
    extras: tuple[str, ...] = ()  # names of setup.cfg extras (damcha_hf.optional_packages.EXTRAS)

    def __str__(self) -> str:
        return self.command


def quick_runs() -> list[QuickRun]:
    """Every row of the README's quick-run table."""
    runs = []
    for match in QUICK_RUN_ROW.finditer(README.read_text()):
        needs = () if match["needs"] == "nothing" else tuple(name.strip() for name in match["needs"].split(","))
        extras = tuple(EXTRA.match(name)["name"] for name in needs if EXTRA.match(name))
        data_sets = tuple(name for name in needs if not EXTRA.match(name))
        seconds = float(match["time"]) * SECONDS[match["unit"]]
        runs.append(QuickRun(match["command"], data_sets, seconds, float(match["load"]), extras))
    return runs


# The ViT denoiser: a tiny config and a model whose noise head is off its zero start.
TINY_DENOISER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": 8,
    "patch_size": 2,
    "num_channels": 1,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "metric_hidden_size": 16,
    "time_embedding_size": 16,
}


def tiny_denoiser_config(**overrides) -> damcha_hf.DamchaViTDenoiserConfig:
    return damcha_hf.DamchaViTDenoiserConfig(**{**TINY_DENOISER, **overrides})


def randomize_head(model, seed: int = 0) -> None:
    """Move the noise head (which starts at zero) to random weights, so that the output depends on the encoder."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.noise_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def denoiser(seed: int = 0, attn: str = "eager", **overrides):
    torch.manual_seed(seed)
    model = damcha_hf.DamchaViTDenoiserModel(tiny_denoiser_config(**overrides)).eval()
    model.set_attn_implementation(attn)
    randomize_head(model, seed)
    return model
