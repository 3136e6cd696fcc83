"""Every DAMCHA architecture the plugin ships, and lookups over their declarations (`modeling/damcha_family.py`).

Registration, conversion, the Hub card, `damcha-hf info` / `inspect` and the LoRA recipe read these declarations
instead of keeping their own per-architecture tables; adding an architecture adds one entry to `FAMILIES`.
"""

from .modeling.damcha_family import DamchaFamily
from .modeling.modeling_damcha_bart import DAMCHA_FAMILY as BART_FAMILY
from .modeling.modeling_damcha_gemma2 import DAMCHA_FAMILY as GEMMA2_FAMILY
from .modeling.modeling_damcha_gpt2 import DAMCHA_FAMILY as GPT2_FAMILY
from .modeling.modeling_damcha_llama import DAMCHA_FAMILY as LLAMA_FAMILY
from .modeling.modeling_damcha_mistral import DAMCHA_FAMILY as MISTRAL_FAMILY
from .modeling.modeling_damcha_phi3 import DAMCHA_FAMILY as PHI3_FAMILY
from .modeling.modeling_damcha_qwen2 import DAMCHA_FAMILY as QWEN2_FAMILY
from .modeling.modeling_damcha_qwen3 import DAMCHA_FAMILY as QWEN3_FAMILY
from .modeling.modeling_damcha_vit import DAMCHA_FAMILY as VIT_FAMILY
from .modeling.modeling_damcha_vit_denoiser import DAMCHA_FAMILY as VIT_DENOISER_FAMILY

FAMILIES: tuple[DamchaFamily, ...] = (
    GPT2_FAMILY,
    LLAMA_FAMILY,
    VIT_FAMILY,
    BART_FAMILY,
    MISTRAL_FAMILY,
    QWEN2_FAMILY,
    QWEN3_FAMILY,
    PHI3_FAMILY,
    GEMMA2_FAMILY,
)
# Architectures with no transformers class to convert from (the ViT denoiser): registered, saved, loaded as remote code
# and given model cards like those above, but conversion and the stock-model contract do not apply to them.
NATIVE_FAMILIES: tuple[DamchaFamily, ...] = (VIT_DENOISER_FAMILY,)


def family_for_model_type(model_type: str | None) -> DamchaFamily | None:
    """The family of a stock (`"llama"`) or DAMCHA (`"damcha_llama"`) `model_type`, or None."""
    return next((f for f in (*FAMILIES, *NATIVE_FAMILIES) if model_type in (f.model_type, f.damcha_model_type)), None)


def family_of(model_or_config) -> DamchaFamily:
    """The family of a model or config (stock or DAMCHA); a `ValueError` listing the supported ones otherwise."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    family = family_for_model_type(model_type)
    if family is None:
        supported = ", ".join(f"{f.model_type} / {f.damcha_model_type}" for f in FAMILIES)
        supported += "".join(f", {f.damcha_model_type}" for f in NATIVE_FAMILIES)
        raise ValueError(f"{model_type!r} is not an architecture damcha_hf supports; supported: {supported}.")
    return family


def presets() -> dict[str, tuple[type, object]]:
    """`damcha-hf info` presets of every family: name -> (model class, config factory)."""
    return {name: preset for family in FAMILIES for name, preset in family.presets.items()}


def supported_architectures(families=FAMILIES) -> str:
    """The architectures of `families` named for an error message: `GPT-2 (gpt2), Llama (llama), ...`."""
    return ", ".join(f"{family.display_name} ({family.model_type})" for family in families)
