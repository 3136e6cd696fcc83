"""Registration of the DAMCHA configs and models with the transformers Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
)

from .modeling.configuration_damcha_gpt2 import DamchaGPT2Config
from .modeling.configuration_damcha_llama import DamchaLlamaConfig
from .modeling.configuration_damcha_vit import DamchaViTConfig
from .modeling.modeling_damcha_gpt2 import (
    DamchaGPT2ForSequenceClassification,
    DamchaGPT2LMHeadModel,
    DamchaGPT2Model,
)
from .modeling.modeling_damcha_llama import (
    DamchaLlamaForCausalLM,
    DamchaLlamaForSequenceClassification,
    DamchaLlamaModel,
)
from .modeling.modeling_damcha_vit import DamchaViTForImageClassification, DamchaViTModel

# (config class, [(auto class, model class), ...]) for every DAMCHA architecture.
AUTO_CLASS_TABLE = [
    (
        DamchaGPT2Config,
        [
            (AutoModel, DamchaGPT2Model),
            (AutoModelForCausalLM, DamchaGPT2LMHeadModel),
            (AutoModelForSequenceClassification, DamchaGPT2ForSequenceClassification),
        ],
    ),
    (
        DamchaLlamaConfig,
        [
            (AutoModel, DamchaLlamaModel),
            (AutoModelForCausalLM, DamchaLlamaForCausalLM),
            (AutoModelForSequenceClassification, DamchaLlamaForSequenceClassification),
        ],
    ),
    (
        DamchaViTConfig,
        [
            (AutoModel, DamchaViTModel),
            (AutoModelForImageClassification, DamchaViTForImageClassification),
        ],
    ),
]


def register_auto_classes() -> None:
    """Make the Auto classes resolve DAMCHA types in this process, and saved checkpoints carry remote code.

    `register_for_auto_class` makes `save_pretrained` write `auto_map` and copy the model files, so a checkpoint
    loads with `trust_remote_code=True` where this package is not installed.
    """
    for config_class, model_classes in AUTO_CLASS_TABLE:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_class in model_classes:
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)
