"""The declaration of a DAMCHA architecture ("family"): everything the plugin's services need to know about it.

Each model file ends with one `DamchaFamily` (e.g. `modeling_damcha_llama.DAMCHA_FAMILY`), and registration with the
Auto classes, conversion from the stock transformers model, the Hub card and `auto_map`, `damcha-hf info` and
`inspect`, and the LoRA recipe all read it (`damcha_hf.families` lists them). Adding an architecture is a config file,
a model file ending in its declaration, one line in `damcha_hf/families.py`, and tests (see CONTRIBUTING.md).

Part of the remote-code payload: imports only the standard library.
"""

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DamchaHead:
    """One DAMCHA model class of a family, the Auto class it registers with and the stock class it converts from."""

    # The transformers Auto class, by name: "AutoModel", "AutoModelForCausalLM", ...; None for a head that no Auto class
    # maps to in transformers either (GPT2DoubleHeadsModel): it loads by its own class's `from_pretrained`.
    auto_class: str | None
    model_class: type  # the DAMCHA class, e.g. DamchaLlamaForCausalLM
    # The transformers class whose checkpoints (and in-memory models) convert to it exactly; None for a head with no
    # transformers counterpart (the ViT denoiser), which nothing converts to.
    stock_class: type | None
    pipeline_tag: str | None = None  # the Hub card's pipeline tag of a checkpoint of this head (None: base model)


def no_architecture_options(model) -> dict:
    return {}


@dataclass(frozen=True)
class DamchaFamily:
    """A DAMCHA architecture: its config, its heads, and the facts the services need.

    Fields:
        model_type: the stock transformers `model_type` it extends (`"gpt2"`, `"llama"`, `"vit"`); the DAMCHA
            `model_type` is `config_class.model_type` (`"damcha_llama"`).
        display_name: how a model card names it (`"Llama"`).
        config_class: the DAMCHA config class.
        heads: every DAMCHA model class, the base model first.
        vision: takes `pixel_values` (image processor, image data) rather than `input_ids` (tokenizer, text).
        encoder_decoder: an encoder-decoder (BART): its task head is the sequence-to-sequence model, and `causal`
            describes its decoder.
        lora_target_modules: module names LoRA adapts (the attention and MLP projections).
        lora_fan_in_fan_out: those modules store the weight transposed (GPT-2's `Conv1D`).
        task_head_modules: modules a new task must train in full beside LoRA (a fresh classifier).
        architecture_options: stock model -> constructor keyword arguments that decide which weights exist (ViT's
            pooler and mask token), so the converted model has exactly the source's weights.

    `damcha-hf info`'s presets (the architecture at a published size) are declared beside the config, as
    `INFO_PRESETS` of its module, and read here (`presets`).
    """

    model_type: str
    display_name: str
    config_class: type
    heads: tuple[DamchaHead, ...]
    vision: bool
    lora_target_modules: tuple[str, ...]
    encoder_decoder: bool = False
    lora_fan_in_fan_out: bool = False
    task_head_modules: tuple[str, ...] = ()
    architecture_options: Callable[[object], dict] = no_architecture_options

    @property
    def presets(self) -> dict[str, tuple[type, Callable[..., object]]]:
        """`damcha-hf info`'s presets: name -> (head class, config factory), from the config module's `INFO_PRESETS`."""
        declared = getattr(sys.modules[self.config_class.__module__], "INFO_PRESETS", {})
        heads = {head.model_class.__name__: head.model_class for head in self.heads}
        presets = {}
        for name, preset in declared.items():
            factory = getattr(self.config_class, preset["config"]) if "config" in preset else self.config_class
            presets[name] = (heads[preset["head"]], functools.partial(factory, **preset.get("overrides", {})))
        return presets

    @property
    def causal(self) -> bool:
        """A decoder (`metric_context="sequence"` refused, text generation, language-model data): the config says."""
        return self.config_class.damcha_causal

    @property
    def damcha_model_type(self) -> str:
        return self.config_class.model_type

    def exports(self, *others: type) -> list[str]:
        """Its model file's `__all__`: the declaration (`DAMCHA_FAMILY`), `others` (the file's shared base class, an
        output type) and every head's class, so that a head added to the declaration is exported without being named
        again."""
        return [
            "DAMCHA_FAMILY",
            *(other.__name__ for other in others),
            *(head.model_class.__name__ for head in self.heads),
        ]

    def head_for_auto_class(self, auto_class: str) -> DamchaHead | None:
        return next((head for head in self.heads if head.auto_class == auto_class), None)

    def head_of(self, model_class: type) -> DamchaHead | None:
        """The head whose DAMCHA or stock class is exactly `model_class`."""
        return next((head for head in self.heads if model_class in (head.model_class, head.stock_class)), None)

    @property
    def task_head(self) -> DamchaHead:
        """The head the recipes train: the sequence-to-sequence model of an encoder-decoder, the language model of a
        causal family, else the first head with a task."""
        if self.encoder_decoder:
            preferred = "AutoModelForSeq2SeqLM"
        else:
            preferred = "AutoModelForCausalLM" if self.causal else "AutoModelForImageClassification"
        return self.head_for_auto_class(preferred) or next(head for head in self.heads if head.pipeline_tag)
