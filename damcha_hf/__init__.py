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

# Public names besides the families' configs and model classes -> the module (relative to this package) that defines
# them, imported on first use.
_PUBLIC_MODULES = {
    "DamchaViTDenoiserOutput": ".modeling.modeling_damcha_vit_denoiser",
    "convert_to_damcha": ".conversion",
    "save_hub_checkpoint": ".hub",
    "build_model_card": ".hub",
    "push_checkpoint": ".hub",
    "write_metric_map": ".metric_map",
}


def _family_classes() -> dict[str, type]:
    """Every family's config class and model classes by name, from the family declarations (`families.FAMILIES`).

    Built on first use: the declarations import the model files, and so torch. (Using any DAMCHA class registers the
    Auto classes, which imports every family anyway.)"""
    from .families import FAMILIES, NATIVE_FAMILIES

    classes = {}
    for family in (*FAMILIES, *NATIVE_FAMILIES):
        classes[family.config_class.__name__] = family.config_class
        classes.update((head.model_class.__name__, head.model_class) for head in family.heads)
    return classes


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
    "lm_eval_tasks",
    "metric_map",
    "metrics",
    "modeling",
    "optional_packages",
    "registration",
    "safe_files",
    "training",
)


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import also sets it as an attribute here
    if name == "__all__":  # `from damcha_hf import *`
        return sorted({*_PUBLIC_MODULES, *_family_classes(), "__version__"})
    module = _PUBLIC_MODULES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif name.startswith("Damcha") and name in (classes := _family_classes()):
        value = classes[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")) | set(SUBMODULES))


install_auto_class_registration()
