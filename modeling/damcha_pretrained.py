"""What every DAMCHA `PreTrainedModel` adds to the transformers base class it extends (GPT-2's, Llama's, ViT's), and
what every DAMCHA base model (the layer stack) adds: the stack-shared cross-head metric, passed down to its layers.

Part of the remote-code payload: imports only transformers and its sibling files.
"""

import functools

from transformers import PreTrainedModel

from .damcha_attention import (
    CrossHeadMetric,
    check_attention_backend,
    cross_head_variant_of,
    eager_attn_implementation_for,
    init_cross_head_weights,
)


def _code_reference(cls: type) -> str:
    """`module_file.ClassName`, the form `auto_map` uses for code saved next to the weights."""
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def _saved_config(config_class, pretrained_model_name_or_path, kwargs) -> dict:
    """The checkpoint's own config.json (as saved, before any override), or {} when it cannot be read."""
    names = ("subfolder", "revision", "cache_dir", "local_files_only", "token")
    try:
        saved, _ = config_class.get_config_dict(
            pretrained_model_name_or_path, **{name: kwargs[name] for name in names if name in kwargs}
        )
    except (OSError, ValueError, TypeError):
        return {}
    return saved


def _subclasses(cls: type) -> list[type]:
    found = []
    for subclass in cls.__subclasses__():
        found += [subclass, *_subclasses(subclass)]
    return found


class DamchaPreTrainedMixin:
    """Mixed in before a transformers `*PreTrainedModel`: weight init, backend choice and remote-code saving."""

    # Key-side mixing ("token", "sequence") and plain MHA ("none") hand every backend ordinary (query, key, value)
    # tensors, so flash and flex attention are supported by the class; what a given config cannot run on is refused
    # per config in `_check_and_adjust_attn_implementation` ("query", talking-heads, DCMHA).
    _supports_flash_attn = True
    _supports_flex_attn = True

    def __init__(self, config, *inputs, **kwargs):
        # A config is validated when it is created, but fields set afterwards (`config.metric_context = ...`) and
        # `from_pretrained(..., metric_context=...)` overrides are not: check it again before building any layer, so
        # that e.g. a causal model never runs with metric_context="sequence".
        if hasattr(config, "validate"):
            config.validate()
        # PreTrainedModel's own __init__, not super()'s: in a DAMCHA model class the next class in the MRO is the stock
        # model (e.g. GPT2Model), whose __init__ would build and initialise a whole stock model first, and its
        # post_init would consume `config.gradient_checkpointing` before the DAMCHA layers exist.
        PreTrainedModel.__init__(self, config, *inputs, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        init_cross_head_weights(module, std=self.config.initializer_range)

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        # Talking-heads and DCMHA run only in eager attention: default to it for them, refuse other backends.
        eager_only = eager_attn_implementation_for(self.config, attn_implementation)
        if eager_only is not None:
            return eager_only
        # The expanded query of "query" is wider than the value: only eager and SDPA take it.
        if cross_head_variant_of(self.config) == "damcha" and not isinstance(attn_implementation, dict):
            check_attention_backend(self.config.metric_context, attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, **kwargs)

    def family_auto_map(self) -> dict[str, str]:
        """`auto_map` entries for the config and every model class of this family registered for an Auto class.

        transformers' `save_pretrained` writes only the saved class; listing the whole family lets a checkpoint of
        any head load with every Auto class under `trust_remote_code=True`.
        """
        family = next(cls for cls in type(self).__mro__ if DamchaPreTrainedMixin in cls.__bases__)
        auto_map = {"AutoConfig": _code_reference(type(self.config))}
        for cls in [family, *_subclasses(family)]:
            if getattr(cls, "_auto_class", None) and cls.__module__ == self._defining_class().__module__:
                auto_map[cls._auto_class] = _code_reference(cls)
        return auto_map

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        # A DAMCHA checkpoint without its metric-generator weights would load with the generator at zero, i.e. as
        # plain multi-head attention, with only transformers' generic MISSING report: refuse it. (Converting a stock
        # GPT-2 / ViT / Llama checkpoint, which has no generator, is the intended way to start from zero.)
        wants_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        missing = sorted(key for key in loading_info["missing_keys"] if "cross_head_metric." in key)
        if missing and getattr(model.config, "cross_head_variant", "damcha") == "damcha":
            saved = _saved_config(cls.config_class, pretrained_model_name_or_path, kwargs)
            if str(saved.get("model_type", "")).startswith("damcha_") and saved.get("cross_head_variant", "damcha") == (
                "damcha"
            ):
                raise ValueError(
                    f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}): this DAMCHA checkpoint "
                    f"lacks metric-generator weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), "
                    "so the model would silently run as plain multi-head attention. Use a complete checkpoint (save "
                    "it again from the trained model), keep its `metric_sharing` when loading, or pass "
                    "`cross_head_variant='none'` if plain attention is what you want."
                )
        return (model, loading_info) if wants_loading_info else model

    def _defining_class(self) -> type:
        """The model class as the modeling files define it. FSDP2's `fully_shard` re-classes a model as
        `FSDP<Class>`, a subclass defined in torch; everything saved must name the class it extends."""
        package = DamchaPreTrainedMixin.__module__.rpartition(".")[0]
        return next(cls for cls in type(self).__mro__ if cls.__module__.rpartition(".")[0] == package)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self.is_remote_code():  # registered for remote code: the model files are copied next to the weights
            # Exactly this family's classes: entries naming other code (e.g. carried over from a downloaded
            # checkpoint's config) are dropped, since that code is not saved with the weights.
            self.config.auto_map = self.family_auto_map()
        defining_class, saved_class = self._defining_class(), type(self)
        if defining_class is saved_class:
            return super().save_pretrained(save_directory, *args, **kwargs)
        # An FSDP-wrapped model (`save_pretrained(..., state_dict=accelerator.get_state_dict(model))`): transformers
        # would copy the wrapper's module, torch's FSDP files, as the model code and name `FSDP<Class>` in auto_map.
        self.__class__ = defining_class
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__class__ = saved_class


def stack_cross_head_metric(config) -> CrossHeadMetric | None:
    """The metric generator(s) a base model owns for its whole layer stack (`metric_sharing` decides how many).

    Only DAMCHA has one; the baseline variants (talking-heads, DCMHA, plain attention) carry no unused parameters.
    """
    return CrossHeadMetric.from_config(config) if cross_head_variant_of(config) == "damcha" else None


def forward_with_cross_head_metric(stock_forward):
    """A base model's `forward`: the stock class's `stock_forward` (whose signature it keeps, for `generate` and the
    Trainer's input filtering), called with `cross_head_metric=self.cross_head_metric`, which the stock forward hands on
    to every attention layer through its `**kwargs`.

    The metric travels down with the call, rather than as a module reference held by each layer, so that wrappers
    (PEFT's modules_to_save, FSDP) that replace `self.cross_head_metric` are always the ones used.
    """

    @functools.wraps(stock_forward)
    def forward(self, *args, **kwargs):
        return stock_forward(self, *args, cross_head_metric=self.cross_head_metric, **kwargs)

    return forward
