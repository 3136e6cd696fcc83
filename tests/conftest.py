"""Shared test setup: offline, deterministic, tiny random configs."""

import gzip
import inspect
import os
import random
import struct

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers 5.25 loads attention kernels from the Hub through the `kernels` package unless told not to; where that
# package is absent (5.25 installed with --no-deps, see docs/tested-range.md) every from_pretrained would raise
# "Kernels are not available". The tests use no Hub kernels on any version.
os.environ.setdefault("USE_HUB_KERNELS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import BartConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, ViTConfig  # noqa: E402

import damcha_hf  # noqa: E402,F401  (registers the Auto classes)

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


def tiny_token_ids(batch=2, seq=9, seed=0) -> torch.Tensor:
    """Token ids in 3..96 of the tiny GPT-2's vocabulary, the same for the same seed."""
    return torch.randint(3, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


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


RECIPES_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def load_recipe_module(name: str):
    """A recipe script (`recipes/<name>.py`) imported as a module, its helper modules importable beside it."""
    import importlib.util
    import sys

    if RECIPES_FOLDER not in sys.path:
        sys.path.insert(0, RECIPES_FOLDER)
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES_FOLDER, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
