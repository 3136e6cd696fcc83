"""The DAMCHA config fields shared by every family's config: `cross_head_variant` and the fields each attention
variant declares (`variants.py`), with their docstring and validation.

Each `configuration_damcha_<family>.py` is `DamchaConfigMixin` plus the stock transformers config it extends.

Torch-free, so that the configuration files (and `--help` of the command line and recipes) import it without
importing the attention core. Part of the remote-code payload: imports only the standard library and its siblings.
"""

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass
from typing import ClassVar

from .config_rules import ConfigField, DamchaConfigError, FieldRule, choice_rule, positive_int_rule
from .metric_choices import METRIC_CONTEXTS, METRIC_FORMS, METRIC_INPUT_NORMS, METRIC_MASKS, METRIC_SHARINGS
from .variants import CROSS_HEAD_VARIANTS, DEFAULT_VARIANT, VARIANTS, variant_config_fields, variant_of, variant_rule

# The transformers releases CI runs (`.ci/run`), oldest first: setup.cfg's range runs from the oldest (5.16.1, what
# vLLM's newest release installs beside) up to the minor version after the newest, its upper bound moved with each new
# release tested. Minor versions between two listed ones are in the range but not run (CI's time allows four).
# Remote code on the Hub runs on whatever transformers its user has, so the model files warn once outside this range.
TESTED_TRANSFORMERS = ("5.16.1", "5.19.0", "5.25.0")

# The fields every DAMCHA config has: the variant, then each variant's own fields (`variants.py`).
VARIANT_FIELDS: dict[str, ConfigField] = {
    "cross_head_variant": ConfigField(
        str,
        DEFAULT_VARIANT,
        variant_rule(),
        textwrap.fill(
            "The attention of every self-attention layer, so that comparisons differ only in attention: "
            + ", ".join(variant.config_doc for variant in VARIANTS.values())
            + ". Every variant starts as exact multi-head attention, so any pretrained checkpoint converts to it. A "
            'variant that mixes the `n x n` score maps runs only with `attn_implementation="eager"` (the default for '
            "it; any other backend is refused). Each variant's own fields below apply to it only.",
            width=120,
            initial_indent=" " * 8,
            subsequent_indent=" " * 8,
        ),
        help="the attention variant",
    ),
    **variant_config_fields(),
}

# Docstring fragment shared by the DAMCHA configs, so that all document the fields the same way.
METRIC_OPTIONS_DOCSTRING = "\n" + "".join(field.docstring(name) for name, field in VARIANT_FIELDS.items())

# Every DAMCHA field a config validates on its own, whatever the other fields say. A family adds its own fields'
# rules to `damcha_field_rules` (BART's encoder context, the denoiser's timestep features).
METRIC_FIELD_RULES: dict[str, FieldRule] = {name: field.rule for name, field in VARIANT_FIELDS.items()}

# The name prefixes of the variants' own fields ("metric_", "moa_", ...): an unknown keyword argument that starts with
# one, or is close to a field's name, is taken for a misspelt variant field, which a config would otherwise keep as an
# attribute that nothing reads.
VARIANT_FIELD_PREFIXES = tuple(
    sorted({name[: name.index("_") + 1] for name in VARIANT_FIELDS if name != "cross_head_variant"} | {"cross_head_"})
)


def misspelt_variant_field(name: str) -> str | None:
    """The variant field that `name`, which is no field, most likely misspells; None where it looks like none."""
    close = difflib.get_close_matches(name, VARIANT_FIELDS, n=1, cutoff=0.75)
    if not close and name.startswith(VARIANT_FIELD_PREFIXES):
        close = difflib.get_close_matches(name, VARIANT_FIELDS, n=1, cutoff=0.0)
    return close[0] if close else None


def variant_option_refusal(caller: str, options: dict, known, variant: str | None = None) -> str | None:
    """Why `caller` refuses one of the keyword arguments `options`, in one line, or None.

    Refused: a name that is not in `known` (the names the call accepts) and misspells a variant field, and, where
    `variant` (the variant the call builds) is given, another variant's field set off its default, which that variant
    would not read (at its default it changes nothing: a saved config carries every variant's fields)."""
    for name, value in options.items():
        if name in VARIANT_FIELDS:
            if variant not in VARIANTS or name == "cross_head_variant" or name in VARIANTS[variant].fields:
                continue
            if value == VARIANT_FIELDS[name].default:
                continue
            owner = next(other.name for other in VARIANTS.values() if name in other.fields)
            return (
                f"{caller}: `{name}` is a field of `cross_head_variant={owner!r}`, which this call does not build "
                f"(`cross_head_variant={variant!r}`), so it would be ignored; drop it, or pass "
                f"`cross_head_variant={owner!r}`."
            )
        if name not in known:
            guess = misspelt_variant_field(name)
            if guess is not None:
                return f"{caller}: unknown option `{name}`; did you mean `{guess}`?"
    return None


@functools.cache
def config_keywords(config_class) -> frozenset[str]:
    """The keyword arguments `config_class` reads: its dataclass fields and its other attributes (`num_labels`)."""
    return frozenset({field.name for field in dataclasses.fields(config_class)} | set(dir(config_class)))


__all__ = [
    "CROSS_HEAD_VARIANTS", "METRIC_CONTEXTS", "METRIC_FORMS", "METRIC_INPUT_NORMS", "METRIC_MASKS", "METRIC_SHARINGS", "TESTED_TRANSFORMERS",
    "DamchaConfigError", "DamchaConfigMixin", "DamchaDecoderConfigMixin", "FieldRule", "choice_rule",
    "positive_int_rule", "one_line_config_errors", "config_keywords", "variant_option_refusal",
]  # fmt: skip


def check_metric_options(config, *, causal: bool, rules: dict[str, FieldRule] = METRIC_FIELD_RULES) -> None:
    """Raise a `DamchaConfigError` naming the offending config field and the fix. Shared by every DAMCHA config."""
    name = type(config).__name__
    hidden_size, num_heads = config.hidden_size, config.num_attention_heads
    # A family that declares the head width (`head_dim`: Llama, Mistral, Qwen3, Gemma 2) projects to `H * head_dim`
    # whatever the model width; the cross-head variants work in that space, so the width need not split into heads.
    # A `head_dim` the stock config derived from a width the heads do not divide (`hidden_size // H`) was not chosen.
    head_dim = getattr(config, "head_dim", None)
    free_head_width = isinstance(head_dim, int) and head_dim > 0 and head_dim != hidden_size // max(num_heads, 1)
    if num_heads <= 0 or (hidden_size % num_heads != 0 and not free_head_width):
        raise DamchaConfigError(
            f"{name}: `num_attention_heads` ({num_heads}) must divide `hidden_size` ({hidden_size}); "
            f"pick a head count that divides it, such as {_nearest_divisors(hidden_size, num_heads)}."
        )
    for field, rule in rules.items():
        if hasattr(config, field):  # a stock config checked for conversion lacks the fields; it takes the defaults
            message = rule.refusal(name, field, getattr(config, field))
            if message:
                raise DamchaConfigError(message)
    refusal = variant_of(config).config_refusal(config)
    if refusal:
        raise DamchaConfigError(refusal)
    if causal and getattr(config, "metric_context", None) == "sequence":
        raise DamchaConfigError(
            f"{name}: `metric_context='sequence'` averages over the whole sequence, which would let a causal "
            "model see future tokens; use `metric_context='token'` (or `'query'`) for causal models."
        )


def one_line_config_errors(config_class):
    """Applied over `@strict` to each DAMCHA config class: a value its validation refuses raises `DamchaConfigError`
    (one line, a `ValueError`) instead of huggingface_hub's `StrictDataclass*ValidationError`. A DAMCHA field is also
    checked against its rule (`damcha_field_rules`) whenever it is set, so `config.metric_mask = "diagnoal"` is refused
    at once, with the same message as the constructor's."""
    strict_init, strict_validate, strict_setattr = (
        config_class.__dict__[name] for name in ("__init__", "validate", "__setattr__")
    )

    @functools.wraps(strict_init)
    def __init__(self, *args, **kwargs):
        # transformers keeps an unknown keyword as an attribute; a misspelt variant field would then be ignored.
        refusal = variant_option_refusal(type(self).__name__, kwargs, config_keywords(type(self)))
        if refusal:
            raise DamchaConfigError(refusal)
        try:
            strict_init(self, *args, **kwargs)
        except Exception as error:
            _raise_in_one_line(error, type(self).__name__)
            raise

    @functools.wraps(strict_validate)  # keeps `__is_defined_by_strict_decorator__`: subclasses may be `@strict` too
    def validate(self):
        try:
            strict_validate(self)
        except Exception as error:
            _raise_in_one_line(error, type(self).__name__)
            raise

    @functools.wraps(strict_setattr)
    def __setattr__(self, name, value):
        rule = type(self).damcha_field_rules.get(name)
        message = rule and rule.refusal(type(self).__name__, name, value)
        if message:
            raise DamchaConfigError(message)
        try:
            strict_setattr(self, name, value)
        except Exception as error:
            _raise_in_one_line(error, type(self).__name__, field=name, value=value)
            raise

    config_class.__init__, config_class.validate, config_class.__setattr__ = __init__, validate, __setattr__
    return config_class


def _raise_in_one_line(error: Exception, config_name: str, *, field: str | None = None, value=None) -> None:
    """Raise huggingface_hub's validation `error` as a one-line `DamchaConfigError`; return on any other error."""
    # Matched by name: this file imports nothing outside the standard library.
    if not type(error).__name__.startswith("StrictDataclass") or error.__cause__ is None:
        return
    cause = " ".join(str(error.__cause__).split())
    if field is not None:  # huggingface_hub's type check: "Field 'x' expected int, got str (value: '1')"
        cause = f"{cause}; give `{field}` a value of that type" if field in cause else f"`{field}`={value!r}: {cause}"
    message = cause if cause.startswith(f"{config_name}:") else f"{config_name}: {cause}"
    raise DamchaConfigError(message) from error.__cause__


def _nearest_divisors(hidden_size: int, num_heads: int) -> str:
    divisors = sorted((h for h in range(1, hidden_size + 1) if hidden_size % h == 0), key=lambda h: abs(h - num_heads))
    return " or ".join(map(str, sorted(divisors[:2])))


class DamchaConfigMixin:
    """The DAMCHA fields, mixed in before a stock transformers config (`class DamchaGPT2Config(DamchaConfigMixin,
    GPT2Config)`, decorated `@one_line_config_errors` over `@strict`). A family sets `model_type = "damcha_<stock model_type>"` and `damcha_causal`,
    and may override a field's default (ViT: `metric_context: str = "sequence"`)."""

    # A decoder: `metric_context="sequence"` would let it see future tokens, so it is refused.
    damcha_causal: ClassVar[bool] = True
    # What each DAMCHA field accepts (`one_line_config_errors` checks a field whenever it is set).
    damcha_field_rules: ClassVar[dict[str, FieldRule]] = METRIC_FIELD_RULES

    # Its dataclass fields are `VARIANT_FIELDS` (`cross_head_variant` and each variant's own), added below.

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and METRIC_OPTIONS_DOCSTRING not in cls.__doc__:
            cls.__doc__ += METRIC_OPTIONS_DOCSTRING

    def validate_metric_options(self):
        check_metric_options(self, causal=self.damcha_causal, rules=self.damcha_field_rules)

    def check_damcha_fields(self):
        """Run the validators this project adds (the `validate_*` methods of the DAMCHA config classes), not the stock
        config's. A stock config is validated when it is built; a stock model built from it later (transformers' own
        tests change `rope_parameters` so) runs what the stock validation would refuse, and a DAMCHA model must build
        where the stock one does. (Named apart from `validate_*`, which `@strict` would run as a validator.)"""
        package = DamchaConfigMixin.__module__.rpartition(".")[0]
        names = {
            name
            for cls in type(self).__mro__
            if cls.__module__.rpartition(".")[0] == package
            for name in vars(cls)
            if name.startswith("validate_") and callable(vars(cls)[name])
        }
        for name in sorted(names):
            getattr(self, name)()

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        saved = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        self._keep_only_the_saved_code(save_directory)
        return saved

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # `save_pretrained(..., push_to_hub=True)` uploads from inside transformers' save: reduce the code first.
        self._keep_only_the_saved_code(working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)

    def _keep_only_the_saved_code(self, folder) -> None:
        """A config registered for remote code copies its file and every file it imports, the registry of every
        variant included: leave only the code of its variant and plain attention (`checkpoint_code.py`), as a model's
        save does. Reduced for every entry `auto_map` names, so that inside a model's save (which writes the config
        with the whole family's `auto_map`) the model's files stay."""
        if getattr(self, "_auto_class", None) is None or not os.path.isdir(folder):
            return
        from .checkpoint_code import keep_only_the_saved_code
        from .variants import PLUGIN_VARIANTS

        package = DamchaConfigMixin.__module__.rpartition(".")[0]
        defining_class = next(cls for cls in type(self).__mro__ if cls.__module__.rpartition(".")[0] == package)
        kept_variants = (variant_of(self), VARIANTS["none"])
        keep_only_the_saved_code(
            folder,
            code_folder=os.path.dirname(inspect.getfile(defining_class)),
            entry_modules={
                reference.rpartition(".")[0]
                for reference in (getattr(self, "auto_map", None) or {}).values()
                if isinstance(reference, str) and "--" not in reference
            },
            kept_variant_modules={type(variant).__module__.rpartition(".")[2] for variant in kept_variants},
            plugin_variants=PLUGIN_VARIANTS,
        )

    @classmethod
    def stock_model_type(cls) -> str:
        return cls.model_type.removeprefix("damcha_")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        # transformers warns that a checkpoint of another `model_type` "is not supported and can yield errors"; this
        # family's stock checkpoint is what the class converts (`from_dict` refuses every other architecture).
        with _quiet_stock_model_type_warning(cls):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        stock = cls.stock_model_type()
        model_type = config_dict.get("model_type")
        # Refused before any weight is touched: only this family's stock and DAMCHA checkpoints convert to it.
        if model_type not in (None, cls.model_type, stock):
            raise ValueError(
                f"{cls.__name__} cannot load a checkpoint whose config has `model_type={model_type!r}`: only "
                f"'{stock}' and '{cls.model_type}' checkpoints convert to it. Load that checkpoint with its own Auto "
                "class, or pass a checkpoint of the matching architecture."
            )
        # A converted stock config is saved under the DAMCHA model_type, so the source's is not carried over.
        config_dict = {key: value for key, value in config_dict.items() if key != "model_type"}
        result = super().from_dict(config_dict, **kwargs)
        # transformers sets the keyword overrides of `from_pretrained(folder, metric_context=...)` with `setattr`
        # after the config was built and validated: validate again so that no override skips it.
        (result[0] if isinstance(result, tuple) else result).check_damcha_fields()
        return result


@contextlib.contextmanager
def _quiet_stock_model_type_warning(config_class):
    """Drop transformers' model-type mismatch warning for `config_class`'s own stock `model_type` only."""
    expected = (
        f"You are using a model of type `{config_class.stock_model_type()}` to instantiate a model of type "
        f"`{config_class.model_type}`."
    )

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(expected)

    logger = logging.getLogger("transformers.configuration_utils")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _with_variant_fields(mixin: type) -> type:
    """`mixin` as a dataclass with a field per entry of `VARIANT_FIELDS` (type and default from the variant that
    declares it), as if they were written in its body: the variants, not this file, decide the fields."""
    for name, field in VARIANT_FIELDS.items():
        mixin.__annotations__[name] = field.type
        setattr(mixin, name, field.default)
    return dataclass(repr=False, kw_only=True)(mixin)


DamchaConfigMixin = _with_variant_fields(DamchaConfigMixin)


class DamchaDecoderConfigMixin(DamchaConfigMixin):
    """`DamchaConfigMixin` for the grouped-query decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2), whose
    `num_key_value_heads` key/value heads each serve a group of query heads: it also refuses the head layouts the
    cross-head variants cannot run (`check_key_value_heads`)."""

    def validate_key_value_heads(self):
        check_key_value_heads(self)


def check_key_value_heads(config) -> None:
    """Refuse head layouts the cross-head variants cannot run, naming the field and the fix."""
    name = type(config).__name__
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(
            f"{name}: `num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({heads}) (grouped-query "
            "attention); pick a divisor, or leave it unset for multi-head attention."
        )
    refusal = variant_of(config).head_layout_refusal(config, heads, kv_heads)
    if refusal:
        raise ValueError(refusal)
