"""damcha-hf: DAMCHA attention for Hugging Face Transformers.

`import damcha_hf` is cheap: it imports neither torch nor transformers. Each public name below is imported on first
use, and the DAMCHA configs and models are registered with the Auto classes (`AutoConfig`, `AutoModel`,
`AutoModelForCausalLM`, `AutoModelForSequenceClassification`, `AutoModelForImageClassification`, ...) as soon as
transformers loads those classes (`damcha_hf.registration`), so `import damcha_hf` then
`AutoModelForCausalLM.from_pretrained(...)` needs no `trust_remote_code`. The classes are also marked for remote code,
so that `save_pretrained` writes an `auto_map` and copies the model files next to the weights.

Public API:
    DamchaGPT2Config, DamchaGPT2Model, DamchaGPT2LMHeadModel, DamchaGPT2ForSequenceClassification,
        DamchaGPT2ForTokenClassification, DamchaGPT2ForQuestionAnswering, DamchaGPT2DoubleHeadsModel
    DamchaLlamaConfig, DamchaLlamaModel, DamchaLlamaForCausalLM, DamchaLlamaForSequenceClassification,
        DamchaLlamaForQuestionAnswering, DamchaLlamaForTokenClassification   (GQA too)
    DamchaViTConfig, DamchaViTModel, DamchaViTForImageClassification, DamchaViTForMaskedImageModeling
        (DamchaViTConfig.vit_small_patch16_224())
    DamchaBartConfig, DamchaBartModel, DamchaBartForConditionalGeneration, DamchaBartForSequenceClassification,
        DamchaBartForQuestionAnswering, DamchaBartForCausalLM   (encoder-decoder; DamchaBartConfig.bart_base())
    DamchaMistralConfig, DamchaQwen2Config, DamchaQwen3Config, DamchaPhi3Config, DamchaGemma2Config and their
        Damcha<Family>Model, ...ForCausalLM, ...ForSequenceClassification, ...ForTokenClassification (and
        ...ForQuestionAnswering for Mistral, Qwen2 and Qwen3)   the rotary decoders (docs/decoder-families.md)
    DamchaViTDenoiserConfig, DamchaViTDenoiserModel, DamchaViTDenoiserOutput   a diffusion noise predictor on the
        DAMCHA ViT encoder (schedulers and sampling: damcha_hf.diffusion, `pip install damcha-hf[diffusion]`)
    convert_to_damcha(model, **metric_options)   an in-memory model of any family above -> its DAMCHA counterpart
    save_hub_checkpoint, build_model_card, push_checkpoint   Hub export (damcha_hf.hub); write_metric_map (the C heatmap)
"""

from __future__ import annotations

import importlib

from .registration import install_auto_class_registration

__version__ = "0.1.0"

# Public name -> the module (relative to this package) that defines it, imported on first use.
_PUBLIC_MODULES = {
    "DamchaGPT2Config": ".modeling.configuration_damcha_gpt2",
    "DamchaLlamaConfig": ".modeling.configuration_damcha_llama",
    "DamchaViTConfig": ".modeling.configuration_damcha_vit",
    "DamchaBartConfig": ".modeling.configuration_damcha_bart",
    "DamchaViTDenoiserConfig": ".modeling.configuration_damcha_vit_denoiser",
    **dict.fromkeys(
        (
            "DamchaGPT2Model",
            "DamchaGPT2LMHeadModel",
            "DamchaGPT2ForSequenceClassification",
            "DamchaGPT2ForTokenClassification",
            "DamchaGPT2ForQuestionAnswering",
            "DamchaGPT2DoubleHeadsModel",
        ),
        ".modeling.modeling_damcha_gpt2",
    ),
    **dict.fromkeys(
        (
            "DamchaLlamaModel",
            "DamchaLlamaForCausalLM",
            "DamchaLlamaForSequenceClassification",
            "DamchaLlamaForQuestionAnswering",
            "DamchaLlamaForTokenClassification",
        ),
        ".modeling.modeling_damcha_llama",
    ),
    **dict.fromkeys(
        ("DamchaViTModel", "DamchaViTForImageClassification", "DamchaViTForMaskedImageModeling"),
        ".modeling.modeling_damcha_vit",
    ),
    **dict.fromkeys(
        (
            "DamchaBartModel",
            "DamchaBartForConditionalGeneration",
            "DamchaBartForSequenceClassification",
            "DamchaBartForQuestionAnswering",
            "DamchaBartForCausalLM",
        ),
        ".modeling.modeling_damcha_bart",
    ),
    **dict.fromkeys(("DamchaViTDenoiserModel", "DamchaViTDenoiserOutput"), ".modeling.modeling_damcha_vit_denoiser"),
    "DamchaMistralConfig": ".modeling.configuration_damcha_mistral",
    **dict.fromkeys(
        (
            "DamchaMistralModel",
            "DamchaMistralForCausalLM",
            "DamchaMistralForSequenceClassification",
            "DamchaMistralForTokenClassification",
            "DamchaMistralForQuestionAnswering",
        ),
        ".modeling.modeling_damcha_mistral",
    ),
    "DamchaQwen2Config": ".modeling.configuration_damcha_qwen2",
    **dict.fromkeys(
        (
            "DamchaQwen2Model",
            "DamchaQwen2ForCausalLM",
            "DamchaQwen2ForSequenceClassification",
            "DamchaQwen2ForTokenClassification",
            "DamchaQwen2ForQuestionAnswering",
        ),
        ".modeling.modeling_damcha_qwen2",
    ),
    "DamchaQwen3Config": ".modeling.configuration_damcha_qwen3",
    **dict.fromkeys(
        (
            "DamchaQwen3Model",
            "DamchaQwen3ForCausalLM",
            "DamchaQwen3ForSequenceClassification",
            "DamchaQwen3ForTokenClassification",
            "DamchaQwen3ForQuestionAnswering",
        ),
        ".modeling.modeling_damcha_qwen3",
    ),
    "DamchaPhi3Config": ".modeling.configuration_damcha_phi3",
    **dict.fromkeys(
        (
            "DamchaPhi3Model",
            "DamchaPhi3ForCausalLM",
            "DamchaPhi3ForSequenceClassification",
            "DamchaPhi3ForTokenClassification",
        ),
        ".modeling.modeling_damcha_phi3",
    ),
    "DamchaGemma2Config": ".modeling.configuration_damcha_gemma2",
    **dict.fromkeys(
        (
            "DamchaGemma2Model",
            "DamchaGemma2ForCausalLM",
            "DamchaGemma2ForSequenceClassification",
            "DamchaGemma2ForTokenClassification",
        ),
        ".modeling.modeling_damcha_gemma2",
    ),
    "convert_to_damcha": ".conversion",
    "save_hub_checkpoint": ".hub",
    "build_model_card": ".hub",
    "push_checkpoint": ".hub",
    "write_metric_map": ".metric_map",
}

__all__ = [*_PUBLIC_MODULES, "__version__"]


# The package's own modules, reachable as attributes after a plain `import damcha_hf` (`damcha_hf.hub.push_checkpoint`,
# `damcha_hf.metrics.load_metric`), each imported on first use.
SUBMODULES = (
    "argument_checks",
    "cli",
    "commands",
    "conversion",
    "data",
    "data_sources",
    "diffusion",
    "families",
    "hub",
    "metric_map",
    "metrics",
    "modeling",
    "registration",
    "safe_files",
    "training",
)


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import also sets it as an attribute here
    module = _PUBLIC_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(SUBMODULES))


install_auto_class_registration()
