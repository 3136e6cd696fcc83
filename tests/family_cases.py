"""The families' test cases: a tiny stock config and inputs per family (`CASES`), and DAMCHA models converted from
them with their cross-head parameters moved off the MHA start (`trained_model`). Shared by the family harness
(test_families.py) and the checkpoint-code tests."""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from conftest import TINY_VIT, randomize_cross_head, tiny_bart_config, tiny_gpt2_config, tiny_llama_config
from tiny_decoders import tiny_stock_config

import damcha_hf
from damcha_hf.modeling.damcha_config import METRIC_FORMS
from damcha_hf.modeling.damcha_family import DamchaFamily, DamchaHead
from damcha_hf.modeling.variants import VARIANTS, backends_of


@dataclass(frozen=True)
class FamilyCase:
    family: DamchaFamily
    stock_config: Callable[[], transformers.PretrainedConfig]  # a tiny config of the stock architecture
    inputs: Callable[[], dict]  # a batch for any head of the family
    contexts: tuple[str, ...]  # the metric contexts the family offers
    # The attention backends the stock class runs, the last one the default here (stock Gemma 2 refuses SDPA, which
    # cannot soft-cap the logits).
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")


def text_inputs() -> dict:
    return {"input_ids": torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))}


def source_inputs() -> dict:
    """Sources ending in </s>, as BART's sequence classifier needs."""
    inputs = text_inputs()
    inputs["input_ids"][:, -1] = 2
    return inputs


def image_inputs() -> dict:
    shape = (2, TINY_VIT["num_channels"], TINY_VIT["image_size"], TINY_VIT["image_size"])
    return {"pixel_values": torch.randn(shape, generator=torch.Generator().manual_seed(0))}


CASES = {
    "gpt2": FamilyCase(damcha_hf.families.GPT2_FAMILY, lambda: tiny_gpt2_config(num_labels=3), text_inputs,
                       ("token", "query")),
    "llama": FamilyCase(damcha_hf.families.LLAMA_FAMILY, lambda: tiny_llama_config(num_labels=3), text_inputs,
                        ("token", "query")),
    "vit": FamilyCase(damcha_hf.families.VIT_FAMILY, lambda: transformers.ViTConfig(**TINY_VIT), image_inputs,
                      ("sequence", "token", "query")),
    "bart": FamilyCase(damcha_hf.families.BART_FAMILY, lambda: tiny_bart_config(num_labels=3), source_inputs,
                       ("token", "query")),
    "mistral": FamilyCase(damcha_hf.families.MISTRAL_FAMILY, lambda: tiny_stock_config("mistral", num_labels=3),
                          text_inputs, ("token", "query")),
    "qwen2": FamilyCase(damcha_hf.families.QWEN2_FAMILY, lambda: tiny_stock_config("qwen2", num_labels=3),
                        text_inputs, ("token", "query")),
    "qwen3": FamilyCase(damcha_hf.families.QWEN3_FAMILY, lambda: tiny_stock_config("qwen3", num_labels=3),
                        text_inputs, ("token", "query")),
    "phi3": FamilyCase(damcha_hf.families.PHI3_FAMILY, lambda: tiny_stock_config("phi3", num_labels=3),
                       text_inputs, ("token", "query")),
    "gemma2": FamilyCase(damcha_hf.families.GEMMA2_FAMILY, lambda: tiny_stock_config("gemma2", num_labels=3),
                         text_inputs, ("token", "query"), attn_implementations=("eager",)),
}  # fmt: skip


def mixes_score_maps(variant: str, form: str) -> bool:
    """Talking-heads, DCMHA and DAMCHA's "scores" form mix the n x n score maps: eager attention only (their variants
    declare no other backend), with their own softmax."""
    return backends_of(variant, metric_form=form) == ("eager",)


def first_output(outputs) -> torch.Tensor:
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]


def stock_config_for(name: str, variant: str) -> transformers.PretrainedConfig:
    """The family's tiny stock config; multi-head (as many key/value heads as query heads) for the variants that mix
    the score maps of all query heads, which grouped-query families offer for multi-head attention only."""
    config = CASES[name].stock_config()
    if not VARIANTS[variant].grouped_query and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads
    return config


def trained_model(name: str, head: DamchaHead | None = None, attn: str | None = None, dtype=torch.float64,
                  **options):  # fmt: skip
    """A DAMCHA model of the family's task head (or `head`), converted from a random stock model, with its cross-head
    parameters moved off their MHA start (as after training), in `dtype`. `attn` defaults to the family's default
    backend here, or eager where the variant mixes the score maps (the only backend that runs them)."""
    case = CASES[name]
    variant = options.get("cross_head_variant", "damcha")
    head = head or case.family.task_head
    stock = head.stock_class(stock_config_for(name, variant)).eval()
    with warnings.catch_warnings():  # MoA's sparse start is not the stock model's: expected, the parameters move anyway
        warnings.filterwarnings("ignore", "convert_to_damcha: with `moa_top_k")
        model = damcha_hf.convert_to_damcha(stock, **options).eval()
    if not mixes_score_maps(variant, options.get("metric_form", METRIC_FORMS[0])):
        model.set_attn_implementation(attn or case.attn_implementations[-1])
    elif attn not in (None, "eager"):
        raise ValueError(f"{variant} runs in eager attention only, not {attn!r}")
    randomize_cross_head(model)
    return model.to(dtype)
