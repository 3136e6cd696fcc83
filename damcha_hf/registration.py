"""Registration of the DAMCHA configs and models with the transformers Auto classes, from the family declarations."""

import transformers
from transformers import AutoConfig

from .families import FAMILIES

# (config class, [(auto class, model class), ...]) for every DAMCHA architecture, as the Hub export reads it.
AUTO_CLASS_TABLE = [
    (
        family.config_class,
        [(getattr(transformers, head.auto_class), head.model_class) for head in family.heads if head.auto_class],
    )
    for family in FAMILIES
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
