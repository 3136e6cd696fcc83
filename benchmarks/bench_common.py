"""Helpers shared by the benchmark scripts: model builders for every row, and small utilities.

The rows are built from whatever the installed `damcha_hf` offers, so the scripts keep running while parts of the
plugin are still being written: the ViT rows appear once `damcha_hf.DamchaViTConfig` exists, and the baseline rows
(talking-heads, DCMHA, ...) once the configs have a `cross_head_variant` field.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import damcha_hf
from damcha_hf.modeling.damcha_config import CROSS_HEAD_VARIANTS
from damcha_hf.safe_files import write_json

GPT2_CONTEXTS = ("token", "query")  # "sequence" is refused by causal models (it would leak future tokens)
LLAMA_CONTEXTS = ("token", "query")
VIT_CONTEXTS = ("sequence", "token", "query")


@dataclass
class Row:
    """One model of a comparison: `build()` returns a fresh model in train mode."""

    name: str
    build: Callable[[], torch.nn.Module]
    kind: str  # "mha", "damcha" or "variant"


# The baselines every DAMCHA config offers besides DAMCHA itself, in the order the tables list them.
OTHER_CROSS_HEAD_VARIANTS = tuple(variant for variant in CROSS_HEAD_VARIANTS if variant != "damcha")


def gpt2_config_kwargs(layers: int, width: int, heads: int, positions: int, vocab: int, dropout: float = 0.0) -> dict:
    return {
        "vocab_size": vocab,
        "n_positions": positions,
        "n_embd": width,
        "n_layer": layers,
        "n_head": heads,
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def llama_config_kwargs(
    layers: int,
    positions: int,
    vocab: int = 32000,
    width: int = 2048,
    heads: int = 32,
    kv_heads: int = 4,
    intermediate: int = 5632,
) -> dict:
    """A Llama config; the defaults are TinyLlama-1.1B's widths (32 query heads sharing 4 key/value heads)."""
    return {
        "vocab_size": vocab,
        "max_position_embeddings": positions,
        "hidden_size": width,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def vit_config_kwargs(image_size, patch_size, channels, layers, width, heads, labels, dropout=0.0) -> dict:
    return {
        "image_size": image_size,
        "patch_size": patch_size,
        "num_channels": channels,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * width,
        "num_labels": labels,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
    }


def score_mixing_variants() -> tuple[str, ...]:
    """Variants that mix the n x n score maps and therefore run on eager attention only (talking-heads, DCMHA)."""
    try:
        from damcha_hf.modeling.score_mixing import SCORE_MIXING_VARIANTS
    except ImportError:
        return ("talking_heads", "dcmha")
    return tuple(SCORE_MIXING_VARIANTS)


def _paired(damcha: torch.nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    """Copy every weight of the MHA `reference` into `damcha`, so both start from the same point (paired seeds).

    Keys only DAMCHA has (its metric generator, a variant's mixing weights) keep their own init; a reference key that
    DAMCHA lacks would mean a weight silently dropped, and is an error.
    """
    _, unexpected = damcha.load_state_dict(reference.state_dict(), strict=False)
    if unexpected:
        raise RuntimeError(f"weights of the MHA model have no place in {type(damcha).__name__}: {unexpected[:4]}")
    return damcha


def gpt2_rows(
    config_kwargs: dict,
    *,
    contexts=GPT2_CONTEXTS,
    metric_hidden_size: int = 64,
    seed: int = 0,
    variants: bool = True,
    attn_implementation: str = "sdpa",
    parameter_matched_mha: bool = False,
    dcmha_matched_mha: bool = False,
) -> list[Row]:
    """MHA (vanilla `GPT2LMHeadModel`), DAMCHA per `metric_context`, and the baseline variants when available.

    Every model built for the same `seed` starts from the same GPT-2 weights; DAMCHA's metric generator starts at
    zero (its input layer from a seeded normal), so at step 0 every row computes the same function.
    `parameter_matched_mha` adds "MHA +params": vanilla GPT-2 whose MLPs are widened until it has as many parameters
    as DAMCHA (to the nearest MLP unit), the control for DAMCHA's extra generator parameters; `dcmha_matched_mha` adds
    "MHA +DCMHA params", widened to DCMHA's count, the control for its per-layer dynamic projections.
    """

    def mha(implementation=attn_implementation):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(**config_kwargs, attn_implementation=implementation)).train()

    def damcha(implementation=attn_implementation, **options):
        def build():
            reference = mha(implementation)
            torch.manual_seed(seed + 1)
            config = damcha_hf.DamchaGPT2Config(
                **config_kwargs, metric_hidden_size=metric_hidden_size, attn_implementation=implementation, **options
            )
            model = damcha_hf.DamchaGPT2LMHeadModel(config)
            return _paired(model, reference).train()

        return build

    def widened(inner):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(**config_kwargs, n_inner=inner, attn_implementation="sdpa")).train()

    rows = [Row("MHA", mha, "mha")]
    rows += _capacity_controls(
        mha, widened, 4 * config_kwargs["n_embd"], damcha(metric_context="token"),
        parameter_matched_mha=parameter_matched_mha, dcmha_matched_mha=dcmha_matched_mha,
    )  # fmt: skip
    rows += [Row(f"DAMCHA {context}", damcha(metric_context=context), "damcha") for context in contexts]
    if variants:
        rows += _variant_rows(OTHER_CROSS_HEAD_VARIANTS, mha, damcha, "token")
    return rows


def llama_rows(
    config_kwargs: dict,
    *,
    contexts=LLAMA_CONTEXTS,
    metric_hidden_size: int = 64,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> list[Row]:
    """MHA (stock `LlamaForCausalLM`, grouped-query when `num_key_value_heads` < heads) and DAMCHA per context,
    converted from the same stock weights (`convert_to_damcha`: every weight kept, generator at zero)."""

    def mha(implementation=attn_implementation):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**config_kwargs, attn_implementation=implementation)).train()

    def damcha(**options):
        def build():
            reference = mha()
            torch.manual_seed(seed + 1)
            return damcha_hf.convert_to_damcha(reference, metric_hidden_size=metric_hidden_size, **options).train()

        return build

    return [Row("MHA", mha, "mha")] + [
        Row(f"DAMCHA {context}", damcha(metric_context=context), "damcha") for context in contexts
    ]


def _capacity_controls(mha, widened, mlp_width, method, *, parameter_matched_mha, dcmha_matched_mha) -> list[Row]:
    """The capacity controls: vanilla MHA with its MLPs widened by as many units as hold a method's extra parameters
    (to the nearest unit). "MHA +params" matches DAMCHA (`method`), "MHA +DCMHA params" the seed's MHA converted to
    DCMHA. `widened(inner)` builds the vanilla model with MLP width `inner`; the count is taken from built models."""

    def matched(method_build):
        def build():
            reference = mha()
            extra = count_parameters(method_build()) - count_parameters(reference)
            per_unit = count_parameters(widened(mlp_width + 1)) - count_parameters(reference)  # one more MLP unit
            return widened(mlp_width + round(extra / per_unit))

        return build

    def dcmha():
        return damcha_hf.convert_to_damcha(mha(), cross_head_variant="dcmha")

    rows = []
    if parameter_matched_mha:
        rows.append(Row("MHA +params", matched(method), "mha"))
    if dcmha_matched_mha:
        rows.append(Row("MHA +DCMHA params", matched(dcmha), "mha"))
    return rows


def _variant_rows(variants, mha, damcha, context) -> list[Row]:
    """Baseline rows; the score-mixing ones run on eager attention (they cannot use SDPA), so an eager MHA row is
    added as their like-for-like reference."""
    rows = []
    eager_only = score_mixing_variants()
    if any(v in eager_only for v in variants):
        rows.append(Row("MHA (eager)", lambda: mha("eager"), "mha"))
    for variant in variants:
        implementation = "eager" if variant in eager_only else None
        options = {"metric_context": context, "cross_head_variant": variant}
        build = damcha("eager", **options) if implementation else damcha(**options)
        rows.append(Row(f"variant {variant}" + (" (eager)" if implementation else ""), build, "variant"))
    return rows


def vit_rows(
    config_kwargs: dict,
    *,
    contexts=VIT_CONTEXTS,
    metric_hidden_size: int = 64,
    seed: int = 0,
    variants: bool = True,
    attn_implementation: str = "sdpa",
    parameter_matched_mha: bool = False,
    dcmha_matched_mha: bool = False,
) -> list[Row]:
    """MHA (vanilla `ViTForImageClassification`), DAMCHA per context, the baseline variants, and the capacity controls
    of `gpt2_rows` (widened to DAMCHA `"sequence"`'s parameter count, and to DCMHA's)."""

    def mha(implementation=attn_implementation):
        torch.manual_seed(seed)
        return ViTForImageClassification(ViTConfig(**config_kwargs, attn_implementation=implementation)).train()

    def damcha(implementation=attn_implementation, **options):
        def build():
            reference = mha(implementation)
            torch.manual_seed(seed + 1)
            config = damcha_hf.DamchaViTConfig(
                **config_kwargs, metric_hidden_size=metric_hidden_size, attn_implementation=implementation, **options
            )
            model = damcha_hf.DamchaViTForImageClassification(config)
            return _paired(model, reference).train()

        return build

    def widened(inner):
        torch.manual_seed(seed)
        config = ViTConfig(**{**config_kwargs, "intermediate_size": inner}, attn_implementation="sdpa")
        return ViTForImageClassification(config).train()

    rows = [Row("MHA", mha, "mha")]
    rows += _capacity_controls(
        mha, widened, config_kwargs["intermediate_size"], damcha(metric_context="sequence"),
        parameter_matched_mha=parameter_matched_mha, dcmha_matched_mha=dcmha_matched_mha,
    )  # fmt: skip
    rows += [Row(f"DAMCHA {context}", damcha(metric_context=context), "damcha") for context in contexts]
    if variants:
        rows += _variant_rows(OTHER_CROSS_HEAD_VARIANTS, mha, damcha, "sequence")
    return rows


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def median(values):
    return statistics.median(values) if values else float("nan")


def write_json_atomic(path: str, payload) -> None:
    """Write to a temporary file in the same folder and rename, so no half-written file is ever left."""
    write_json(path, payload, indent=2)


def save_figure_atomic(figure, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".png")
    os.close(handle)
    try:
        figure.savefig(temporary, dpi=110, bbox_inches="tight")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def format_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def set_up_device(device_name: str, threads: int) -> tuple[torch.device, str]:
    """The torch device, with `threads` CPU threads, and a one-line description of the machine for the reports."""
    device = torch.device(device_name)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        return device, torch.cuda.get_device_name(device)
    return device, f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
