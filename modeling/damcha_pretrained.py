"""How a DAMCHA model is built from its stock transformers class, and what every DAMCHA `PreTrainedModel` adds.

A DAMCHA class changes only what DAMCHA changes. It inherits its stock class's `__init__` and `forward`: the stock
`__init__` builds the stock model, attention layers included, and calls `post_init`, where `DamchaPreTrainedMixin`
turns each self-attention layer into its family's DAMCHA attention class *in place* (the same object, with every
attribute and weight the stock `__init__` gave it; only its class, so its `forward`, changes, plus the per-layer
module a score-mixing baseline needs) and gives each layer stack its metric generator. An attribute or submodule that
a transformers release adds in a stock `__init__` is therefore on the DAMCHA model too, with no change here.

Part of the remote-code payload: imports only transformers and its sibling files.
"""

import contextvars
import functools
import inspect
import os
import warnings

from torch import nn
from transformers.utils import logging

from .cross_head_variant import BOUND_VARIANT, LAYER_MODULE, STACK_MODULE
from .damcha_config import VARIANT_FIELDS as VARIANT_FIELD_NAMES
from .damcha_config import config_keywords, variant_option_refusal
from .dispatch import attn_implementation_for
from .transformers_releases import register_output_recording
from .variants import DEFAULT_VARIANT, VARIANTS, variant_of

_logger = logging.get_logger(__name__)
# While `from_pretrained` loads a stock checkpoint into a DAMCHA class (a conversion): the list that collects the new
# weights of the variant.
_CONVERTING_STOCK_CHECKPOINT = contextvars.ContextVar("damcha_converting_stock_checkpoint", default=None)


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


def _package_of(cls: type) -> str:
    return cls.__module__.rpartition(".")[0]


def stock_class_of(damcha_class: type) -> type:
    """The first class in `damcha_class`'s MRO defined outside these model files: the transformers class it extends."""
    package = _package_of(DamchaPreTrainedMixin)
    return next(cls for cls in damcha_class.__mro__ if _package_of(cls) != package)


def init_cross_head_weights(module: nn.Module, std: float) -> None:
    """Called from a model's `_init_weights` after the default init: every variant's modules start as exact MHA
    (zero DAMCHA generator output, identity talking-heads matrices, identity DCMHA composition)."""
    for variant in VARIANTS.values():
        variant.init_weights(module, std)


class DamchaAttentionMixin:
    """Mixed in before a stock self-attention class (`class DamchaGPT2Attention(DamchaAttentionMixin,
    GPT2Attention)`). Such a class defines only `forward`: its layers are stock layers turned into it by
    `adopt_stock_layer`, never built by an `__init__` of their own."""

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """Whether `module`, a layer of the stock attention class, becomes this class (GPT-2 keeps its
        cross-attention layers stock)."""
        return True

    @classmethod
    def adopt_stock_layer(cls, module: nn.Module, config, layer_index: int) -> None:
        """Turn the stock layer `module`, the `layer_index`-th self-attention layer of its stack, into this class."""
        module.__class__ = cls
        # Picks the layer's generator under `metric_sharing="layer"`; a stock layer may have no index (ViT).
        if getattr(module, "layer_idx", None) is None:
            module.layer_idx = layer_index
        # The layer index it calls its stack's metric with (an encoder-decoder offsets its cross-attention layers),
        # an instance attribute so that the attention core reads it without `nn.Module.__getattr__`'s miss path.
        module.metric_layer_index = module.layer_idx
        variant = variant_of(config)
        setattr(module, LAYER_MODULE, variant.layer_module(config))
        # Kept by the layer, so that its forward looks nothing up in the registry (`dispatch.layer_variant`).
        setattr(module, BOUND_VARIANT, variant)


class DamchaPreTrainedMixin:
    """Mixed in before a transformers `*PreTrainedModel`: the stock-to-DAMCHA conversion at `post_init`, weight init,
    backend choice, loading and remote-code saving.

    A family's `*PreTrainedModel` sets `damcha_attention_class` (its `DamchaAttentionMixin` class); each class whose
    stock instances hold a stack of attention layers (`DamchaGPT2Model`; BART's encoder and decoder) sets
    `damcha_layer_stack = True` (such a stack owns the stack's metric generator), and a base model that only holds
    stacks (`DamchaBartModel`) sets `damcha_stack_container = True`.
    """

    damcha_attention_class: type
    damcha_layer_stack: bool = False
    damcha_stack_container: bool = False
    damcha_stack_in_container: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _init_registering_base_model(cls)
        # The layer stacks a container of stacks holds (BART's encoder and decoder) leave the reporting to it; marked
        # here, as a class attribute, whichever of the two classes is defined first.
        if DamchaPreTrainedMixin not in cls.__bases__:
            family = cls._family_pretrained_class()
            classes = [family, *_subclasses(family)]
            if any(other.__dict__.get("damcha_stack_container") for other in classes):
                for other in classes:
                    if other.__dict__.get("damcha_layer_stack"):
                        other.damcha_stack_in_container = True

    @classmethod
    def stack_cross_head_metric(cls, config) -> nn.Module | None:
        """The module one layer stack of this class owns (`damcha_layer_stack`): DAMCHA's metric generator(s), or
        whatever the config's variant shares across a stack; None for a variant without one."""
        return variant_of(config).stack_module(config)

    # Key-side mixing ("token", "sequence") and plain MHA ("none") hand every backend ordinary (query, key, value)
    # tensors, so flash and flex attention are supported by the class; what a given config cannot run on is refused
    # per config in `_check_and_adjust_attn_implementation` ("query", talking-heads, DCMHA).
    _supports_flash_attn = True
    _supports_flex_attn = True

    @classmethod
    def _register_base_model(cls, config) -> None:
        """Make `AutoModel.from_config(config)` build this family's DAMCHA base model for `config`'s class.

        The plugin registers its own config classes. Remote code loads the config from one copy of the model files and
        the model from another (transformers names each copy by a hash of the files it imports), so the config class a
        head receives is registered nowhere, and `AutoModel` would ask whether to run the checkpoint's code again."""
        from transformers import AutoModel

        config_class = type(config)
        if (
            getattr(config_class, "model_type", None) != cls.config_class.model_type
            or config_class in AutoModel._model_mapping
        ):
            return
        base = cls._family_base_model_class()
        if base is not None:
            AutoModel.register(config_class, base, exist_ok=True)

    @classmethod
    def _family_base_model_class(cls) -> type | None:
        """This family's base model class (`DamchaLlamaModel`): the DAMCHA class of the model transformers' `AutoModel`
        maps the stock `model_type` to, among the family's classes."""
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        stock_name = MODEL_MAPPING_NAMES.get(cls.config_class.model_type.removeprefix("damcha_"))
        family = cls._family_pretrained_class()
        return next((sub for sub in _subclasses(family) if stock_class_of(sub).__name__ == stock_name), None)

    def post_init(self):
        # A config is validated when it is created, but fields set afterwards (`config.metric_context = ...`) are
        # not: check the DAMCHA fields again before any DAMCHA layer exists (the stock fields as the stock model does).
        self.config.check_damcha_fields()
        self._adopt_stock_layers()
        super().post_init()

    def _adopt_stock_layers(self) -> None:
        """Turn every stock base model, layer stack and self-attention layer the stock `__init__` built into its
        DAMCHA class.

        A head's stock `__init__` builds a stock base model (`self.transformer = GPT2Model(config)`), which has run its
        own `post_init`: its weights are initialised, and `post_init` below initialises only the modules added here.
        """
        family = self._family_pretrained_class()
        inner_classes = {
            stock_class_of(cls): cls
            for cls in [family, *_subclasses(family)]
            if cls.__dict__.get("damcha_layer_stack") or cls.__dict__.get("damcha_stack_container")
        }
        attention = self.damcha_attention_class
        attention_stock = stock_class_of(attention)
        module_class = variant_of(self.config).module_class()
        layer_index = 0
        for module in list(self.modules()):
            if type(module) in inner_classes:
                module.__class__ = inner_classes[type(module)]
                register_output_recording(module)
            # A model of the family reports what the variant's modules record (MoA's loss), except a layer stack
            # that a container of stacks holds (BART's encoder and decoder): `generate` keeps the encoder's output and
            # repeats each of its tensors per beam, which a scalar loss cannot be.
            reports = isinstance(module, DamchaPreTrainedMixin) and not module.damcha_stack_in_container
            if module_class is not None and reports:
                module_class.prepare_model(module)
            if getattr(type(module), "damcha_layer_stack", False):
                layer_index = 0
                if not hasattr(module, STACK_MODULE):
                    setattr(module, STACK_MODULE, module.stack_cross_head_metric(self.config))
            elif type(module) is attention_stock and attention.converts(module):
                attention.adopt_stock_layer(module, self.config, layer_index)
                layer_index += 1

    @classmethod
    def _family_pretrained_class(cls) -> type:
        """The family's `*PreTrainedModel` (e.g. `DamchaGPT2PreTrainedModel`), which every class of the family extends."""
        return next(base for base in cls.__mro__ if DamchaPreTrainedMixin in base.__bases__)

    def _initialize_weights(self, module, is_custom_code: bool = False):
        # transformers initialises a class defined outside it ("custom code") by a shortcut that marks a module without
        # weights of its own (an attention layer) as done without calling `_init_weights`, which skips GPT-2's scaled
        # init of `c_proj`. The DAMCHA classes initialise through the stock `_init_weights`, so they take the stock path.
        super()._initialize_weights(module, False)

    def _init_weights(self, module):
        super()._init_weights(module)
        # BART names its init scale `init_std`, as the stock `_init_weights` reads it.
        std = getattr(self.config, "initializer_range", None) or getattr(self.config, "init_std", 0.02)
        init_cross_head_weights(module, std=std)

    def _set_gradient_checkpointing(self, *args, **kwargs):
        # transformers gives every checkpointed module a fresh checkpointing function here; the variant's module adapts
        # each (MoA hands its router losses out of the checkpointed layer).
        super()._set_gradient_checkpointing(*args, **kwargs)
        module_class = variant_of(self.config).module_class()
        if module_class is None:
            return
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing") and "_gradient_checkpointing_func" in module.__dict__:
                module._gradient_checkpointing_func = module_class.checkpointing_function(
                    module._gradient_checkpointing_func, module
                )

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        # The variant's backends: eager by default for one that mixes the score maps, a refusal naming the fix for a
        # backend it cannot run on (score mixing, DAMCHA's wider "query" heads).
        required = attn_implementation_for(self.config, attn_implementation)
        if required is not None:
            return required
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check, **kwargs)

    def family_auto_map(self) -> dict[str, str]:
        """`auto_map` entries for the config and every model class of this family registered for an Auto class.

        transformers' `save_pretrained` writes only the saved class; listing the whole family lets a checkpoint of
        any head load with every Auto class under `trust_remote_code=True`.
        """
        family = self._family_pretrained_class()
        auto_map = {"AutoConfig": _code_reference(type(self.config))}
        for cls in [family, *_subclasses(family)]:
            if getattr(cls, "_auto_class", None) and cls.__module__ == self._defining_class().__module__:
                auto_map[cls._auto_class] = _code_reference(cls)
        return auto_map

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        # A DAMCHA checkpoint without its variant's weights (DAMCHA's metric generator, a baseline's mixing) would load
        # with them at their start, i.e. as plain multi-head attention, with only transformers' generic MISSING report:
        # refuse it, or, when the caller asked for the loading info (as transformers' own tests and tools do), report
        # it there with a warning. (Converting a stock checkpoint, which has none, is the intended way to start.)
        wants_loading_info = kwargs.pop("output_loading_info", False)
        cls._check_variant_options(pretrained_model_name_or_path, kwargs)
        saved_type = _saved_config(cls.config_class, pretrained_model_name_or_path, kwargs).get("model_type")
        converting = saved_type == cls.config_class.stock_model_type()
        # A stock checkpoint has none of the variant's weights, by design: they start at exact multi-head attention.
        # transformers' report would list each of them as MISSING; one line says what happened instead.
        new_weights = []  # the variant's weights the stock checkpoint lacks, kept out of transformers' report
        scope = _CONVERTING_STOCK_CHECKPOINT.set(new_weights if converting else None)
        try:
            model, loading_info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        finally:
            _CONVERTING_STOCK_CHECKPOINT.reset(scope)
        variant = variant_of(model.config)
        if new_weights:  # asked for, the loading info still lists them
            missing_keys = loading_info["missing_keys"]
            loading_info["missing_keys"] = type(missing_keys)([*missing_keys, *new_weights])
        if converting:
            start = (
                "the metric generator starts at the identity (C = I), so the outputs are the stock model's until it "
                "trains"
                if variant.name == DEFAULT_VARIANT
                else f"the {variant.parameter_kind} weights start at their initial value"
            )
            _logger.warning(
                f"{cls.__name__}: converted from stock `{saved_type}` ({str(pretrained_model_name_or_path)!r}); every "
                f"weight kept, {start}."
            )
        own_modules = (f"{STACK_MODULE}.", f"{LAYER_MODULE}.")
        missing = sorted(key for key in loading_info["missing_keys"] if any(name in key for name in own_modules))
        if missing:
            saved = _saved_config(cls.config_class, pretrained_model_name_or_path, kwargs)
            saved_variant = saved.get("cross_head_variant", DEFAULT_VARIANT)
            if not (str(saved.get("model_type", "")).startswith("damcha_") and saved_variant == variant.name):
                # A checkpoint without this variant's weights (a stock one, or another variant's) is converted, as
                # `convert_to_damcha` converts: ColMHA's compression is fitted to its weights, MoA's sparse start said.
                variant.after_conversion(model, None, caller=f"{cls.__name__}.from_pretrained")
            else:
                message = (
                    f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}): this "
                    f"`cross_head_variant={variant.name!r}` checkpoint lacks {variant.parameter_kind} weights "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), so the model would silently run "
                    "as plain multi-head attention. Use a complete checkpoint (save it again from the trained model), "
                    "keep its config fields (such as `metric_sharing`) when loading, or pass "
                    "`cross_head_variant='none'` if plain attention is what you want."
                )
                if not wants_loading_info:
                    raise ValueError(message)
                warnings.warn(message, stacklevel=2)
        return (model, loading_info) if wants_loading_info else model

    @classmethod
    def _check_variant_options(cls, pretrained_model_name_or_path, kwargs) -> None:
        """Refuse, before any weight is read, a keyword argument of `from_pretrained` that misspells a variant field
        (transformers would hand it to the model's `__init__`, which rejects it with a bare `TypeError`) or belongs to
        another variant than the one loaded (the config would keep it, and nothing read it)."""
        caller = f"{cls.__name__}.from_pretrained"
        variant = kwargs.get("cross_head_variant")
        if variant is None and any(name in VARIANT_FIELD_NAMES for name in kwargs):
            saved = _saved_config(cls.config_class, pretrained_model_name_or_path, kwargs)
            stock = saved.get("model_type") == cls.config_class.stock_model_type()
            variant = saved.get("cross_head_variant", cls.config_class.cross_head_variant if stock else None)
        refusal = variant_option_refusal(caller, kwargs, config_keywords(cls.config_class), variant=variant)
        if refusal:
            raise ValueError(refusal)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        new_weights = _CONVERTING_STOCK_CHECKPOINT.get()
        if new_weights is not None:  # the variant's own weights, new by design; any other stays reported
            own_modules = (f"{STACK_MODULE}.", f"{LAYER_MODULE}.")
            new_weights += sorted(key for key in loading_info.missing_keys if any(name in key for name in own_modules))
            loading_info.missing_keys = {key for key in loading_info.missing_keys if key not in new_weights}

    def _defining_class(self) -> type:
        """The model class as the modeling files define it. FSDP2's `fully_shard` re-classes a model as
        `FSDP<Class>`, a subclass defined in torch; everything saved must name the class it extends."""
        package = _package_of(DamchaPreTrainedMixin)
        return next(cls for cls in type(self).__mro__ if _package_of(cls) == package)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self.is_remote_code():  # registered for remote code: the model files are copied next to the weights
            # Exactly this family's classes: entries naming other code (e.g. carried over from a downloaded
            # checkpoint's config) are dropped, since that code is not saved with the weights.
            self.config.auto_map = self.family_auto_map()
        defining_class, saved_class = self._defining_class(), type(self)
        if defining_class is saved_class:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
            self._keep_only_the_saved_code(save_directory, *args[:1], **kwargs)
            return saved
        # An FSDP-wrapped model (`save_pretrained(..., state_dict=accelerator.get_state_dict(model))`): transformers
        # would copy the wrapper's module, torch's FSDP files, as the model code and name `FSDP<Class>` in auto_map.
        self.__class__ = defining_class
        try:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
            self._keep_only_the_saved_code(save_directory, *args[:1], **kwargs)
            return saved
        finally:
            self.__class__ = saved_class

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # `save_pretrained(..., push_to_hub=True)` uploads from inside transformers' save: reduce the code first.
        self._keep_only_the_saved_code(working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)

    def _keep_only_the_saved_code(self, folder, is_main_process: bool = True, **save_options) -> None:
        """Leave in `folder` only the code this checkpoint runs (`checkpoint_code.py`): its family's, its variant's and
        plain attention's, and the shared core, of the files transformers' save copied there. Only the process that
        copied them changes them (`is_main_process`, as `save_pretrained` takes it)."""
        saves_here = getattr(self, "should_save_on_this_rank", lambda main: main)(is_main_process)
        if not saves_here or not self.is_remote_code() or not os.path.isdir(folder):
            return
        from .checkpoint_code import keep_only_the_saved_code
        from .variants import PLUGIN_VARIANTS

        kept_variants = (variant_of(self.config), VARIANTS["none"])
        keep_only_the_saved_code(
            folder,
            code_folder=os.path.dirname(inspect.getfile(self._defining_class())),
            entry_modules={
                reference.rpartition(".")[0]
                for reference in (self.config.auto_map or {}).values()
                if isinstance(reference, str) and "--" not in reference
            },
            kept_variant_modules={type(variant).__module__.rpartition(".")[2] for variant in kept_variants},
            plugin_variants=PLUGIN_VARIANTS,
        )


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


def _init_registering_base_model(cls: type):
    """`cls`'s stock `__init__` (the next one in its MRO after the DAMCHA classes), run after registering the family's
    base model for the config's class: the stock generic heads (sequence and token classification, question answering)
    build their base model with `AutoModel.from_config(config)` inside it. It keeps the stock signature
    (`functools.wraps`), which transformers reads (ViTModel's `use_mask_token` in its model tests)."""
    stock_init = next(
        klass.__dict__["__init__"]
        for klass in cls.__mro__
        if "__init__" in klass.__dict__ and not issubclass(klass, DamchaPreTrainedMixin)
    )

    @functools.wraps(stock_init)
    def __init__(self, config, *args, **kwargs):
        type(self)._register_base_model(config)
        # Looked up per call, as the MRO gives it, so that a stock `__init__` replaced after import is the one that runs.
        super(DamchaPreTrainedMixin, self).__init__(config, *args, **kwargs)

    return __init__
