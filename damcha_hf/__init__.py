"""damcha-hf: DAMCHA attention for Hugging Face Transformers.

`import damcha_hf` registers every DAMCHA config and model with the Auto classes (`AutoConfig`, `AutoModel`,
`AutoModelForCausalLM`, `AutoModelForSequenceClassification`, `AutoModelForImageClassification`, ...), and marks
them for remote code so that `save_pretrained` writes an `auto_map` and copies the model files next to the weights.

Public API:
    DamchaGPT2Config, DamchaGPT2Model, DamchaGPT2LMHeadModel, DamchaGPT2ForSequenceClassification,
        DamchaGPT2ForTokenClassification, DamchaGPT2ForQuestionAnswering, DamchaGPT2DoubleHeadsModel
    DamchaLlamaConfig, DamchaLlamaModel, DamchaLlamaForCausalLM, DamchaLlamaForSequenceClassification,
        DamchaLlamaForQuestionAnswering, DamchaLlamaForTokenClassification   (GQA too)
    DamchaViTConfig, DamchaViTModel, DamchaViTForImageClassification, DamchaViTForMaskedImageModeling
        (DamchaViTConfig.vit_small_patch16_224())
    convert_to_damcha(model, **metric_options)   an in-memory GPT-2, Llama or ViT model -> its DAMCHA counterpart
    save_hub_checkpoint, build_model_card, push_checkpoint   Hub export (damcha_hf.hub); write_metric_map (the C heatmap)
"""

from .conversion import convert_to_damcha
from .hub import build_model_card, push_checkpoint, save_hub_checkpoint
from .metric_map import write_metric_map
from .modeling.configuration_damcha_gpt2 import DamchaGPT2Config
from .modeling.configuration_damcha_llama import DamchaLlamaConfig
from .modeling.configuration_damcha_vit import DamchaViTConfig
from .modeling.modeling_damcha_gpt2 import (
    DamchaGPT2DoubleHeadsModel,
    DamchaGPT2ForQuestionAnswering,
    DamchaGPT2ForSequenceClassification,
    DamchaGPT2ForTokenClassification,
    DamchaGPT2LMHeadModel,
    DamchaGPT2Model,
)
from .modeling.modeling_damcha_llama import (
    DamchaLlamaForCausalLM,
    DamchaLlamaForQuestionAnswering,
    DamchaLlamaForSequenceClassification,
    DamchaLlamaForTokenClassification,
    DamchaLlamaModel,
)
from .modeling.modeling_damcha_vit import (
    DamchaViTForImageClassification,
    DamchaViTForMaskedImageModeling,
    DamchaViTModel,
)
from .registration import register_auto_classes

register_auto_classes()

__version__ = "0.1.0"

__all__ = [
    "DamchaGPT2Config",
    "DamchaGPT2Model",
    "DamchaGPT2LMHeadModel",
    "DamchaGPT2ForSequenceClassification",
    "DamchaGPT2ForTokenClassification",
    "DamchaGPT2ForQuestionAnswering",
    "DamchaGPT2DoubleHeadsModel",
    "DamchaLlamaConfig",
    "DamchaLlamaModel",
    "DamchaLlamaForCausalLM",
    "DamchaLlamaForSequenceClassification",
    "DamchaLlamaForQuestionAnswering",
    "DamchaLlamaForTokenClassification",
    "DamchaViTConfig",
    "DamchaViTModel",
    "DamchaViTForImageClassification",
    "DamchaViTForMaskedImageModeling",
    "convert_to_damcha",
    "save_hub_checkpoint",
    "build_model_card",
    "push_checkpoint",
    "write_metric_map",
    "__version__",
]
