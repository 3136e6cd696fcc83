"""The DAMCHA config fields shared by every family's config: their names, allowed values, docstring and validation.

Each `configuration_damcha_<family>.py` is `DamchaConfigMixin` plus the stock transformers config it extends. The
option names here are the one table the configs, the command line, the recipes and the experiments read.

Torch-free, so that the configuration files (and `--help` of the command line and recipes) import it without
importing the attention core. Part of the remote-code payload: imports nothing outside the standard library.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

# The transformers releases CI runs (`.ci/run`): setup.cfg's range is exactly these minor versions, its upper bound
# moved with each new release tested. Remote code on the Hub runs on whatever transformers its user has, so the
# model files warn once outside this range.
TESTED_TRANSFORMERS = ("5.23.0", "5.24.0", "5.25.0")

METRIC_CONTEXTS = ("token", "sequence", "query")
METRIC_MASKS = ("full", "diagonal", "offdiagonal")
METRIC_FORMS = ("keys", "scores")
METRIC_SHARINGS = ("stack", "layer")
CROSS_HEAD_VARIANTS = ("damcha", "talking_heads", "dcmha", "none")
# Variants that mix the n x n score maps across heads (`score_mixing.py` maps each to its module).
SCORE_MIXING_VARIANT_NAMES = ("talking_heads", "dcmha")

# Docstring fragment shared by the DAMCHA configs, so that both document the fields the same way.
METRIC_OPTIONS_DOCSTRING = r"""
    cross_head_variant (`str`, *optional*, defaults to `"damcha"`):
        The attention of every self-attention layer, so that comparisons differ only in attention: `"damcha"`
        (data-adaptive cross-head metric, the fields below), `"talking_heads"` (Shazeer et al. 2020: learned `H x H`
        mixing of the logits before the softmax and of the weights after it), `"dcmha"` (Xiao et al. 2024: dynamic
        per-query and per-key low-rank plus diagonal composition of both maps) or `"none"` (plain multi-head
        attention). Every variant starts as exact multi-head attention, so any pretrained checkpoint converts to it.
        `"talking_heads"` and `"dcmha"` mix the `n x n` score maps, so they run only with
        `attn_implementation="eager"` (the default for them; any other backend is refused). The `metric_*` fields
        apply to `"damcha"` only.
    dcmha_rank (`int`, *optional*, defaults to 2):
        Rank `R` of DCMHA's query-wise and key-wise dynamic projections (the paper uses 2). Used by `"dcmha"` only.
    metric_hidden_size (`int`, *optional*, defaults to 64):
        Hidden width `r` of the metric generator MLP (`d -> r -> H*H`, GELU). Its output layer starts at zero, so
        a fresh or converted model computes exactly multi-head attention.
    metric_context (`str`, *optional*):
        What the cross-head matrix `C` depends on: `"token"` (the key token's hidden state; causal-safe),
        `"sequence"` (the mean hidden state of the sequence; bidirectional models only) or `"query"` (the query
        token's hidden state; exact, `H` times the cost of `QK^T`).
    metric_mask (`str`, *optional*, defaults to `"full"`):
        The paper's ablation, applicable at inference to a trained model: `"full"`, `"diagonal"` (no cross-head
        terms, `C_ij = 0` for `i != j`) or `"offdiagonal"` (`C_ii = 0`: head `i` scores only against the other
        heads' keys).
    metric_form (`str`, *optional*, defaults to `"keys"`):
        Which reading of the paper's metric (derived in `metric.py`): `"keys"`, head `i` scores against the keys of
        every head mixed by `C` (rank `d_h` per head; every attention backend and the plain KV cache), or `"scores"`,
        head `i` scores with `sum_j C_ij Q_j K_j^T` (rank up to `H * d_h`; mixes the score maps, so eager attention
        only).
    metric_sharing (`str`, *optional*, defaults to `"stack"`):
        `"stack"`: one generator shared by every layer (each layer feeds it its own input, so each layer still
        gets its own metric). `"layer"`: one generator per layer, for ablation.
"""


class DamchaConfigError(ValueError):
    """A DAMCHA config refused a value: one line naming the config class, the field, the value, what the field accepts
    and the fix. Raised where huggingface_hub's `@strict` validation would raise its own errors (two lines, and not
    `ValueError`s), so that `except ValueError` catches every config error."""


@dataclass(frozen=True)
class FieldRule:
    """What one config field accepts: the check, the accepted values in words, and the fix a refusal suggests."""

    accepts: Callable[[object], bool]
    description: str  # "one of 'token', 'sequence', 'query'", "a positive integer (...)"
    fix: str
    choices: tuple = ()  # a field of named options: refused as "unknown `field` 'x'; choose one of ..."

    def refusal(self, config_name: str, field: str, value) -> str | None:
        """The one-line message refusing `value`, or None when the field accepts it."""
        if self.accepts(value):
            return None
        if self.choices:
            return f"{config_name}: unknown `{field}` {value!r}; choose one of {self.description}."
        return f"{config_name}: `{field}` must be {self.description}, got {value!r}; {self.fix}."


def choice_rule(choices: tuple, *, none_means: str | None = None) -> FieldRule:
    """A field of named options (strings); with `none_means`, None is accepted too and means that."""
    names = ", ".join(map(repr, choices))
    accepted = (*choices, None) if none_means else choices
    return FieldRule(
        accepts=lambda value: isinstance(value, str | type(None)) and value in accepted,
        description=f"{names}, or None for {none_means}" if none_means else names,
        fix="choose one of them",
        choices=choices,
    )


def positive_int_rule(meaning: str, suggestion: str) -> FieldRule:
    return FieldRule(
        accepts=lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0,
        description=f"a positive integer ({meaning})",
        fix=suggestion,
    )


# Every DAMCHA field a config validates on its own, whatever the other fields say. A family adds its own fields'
# rules to `damcha_field_rules` (BART's encoder context, the denoiser's timestep features).
METRIC_FIELD_RULES = {
    "cross_head_variant": choice_rule(CROSS_HEAD_VARIANTS),
    "dcmha_rank": positive_int_rule("the rank of DCMHA's dynamic head projections", "2 is the paper's choice"),
    "metric_hidden_size": positive_int_rule("the metric generator's hidden width", "64 is a good default"),
    "metric_context": choice_rule(METRIC_CONTEXTS),
    "metric_mask": choice_rule(METRIC_MASKS),
    "metric_sharing": choice_rule(METRIC_SHARINGS),
    "metric_form": choice_rule(METRIC_FORMS),
}


def check_metric_options(config, *, causal: bool, rules: dict[str, FieldRule] = METRIC_FIELD_RULES) -> None:
    """Raise a `DamchaConfigError` naming the offending config field and the fix. Shared by every DAMCHA config."""
    name = type(config).__name__
    hidden_size, num_heads = config.hidden_size, config.num_attention_heads
    if num_heads <= 0 or hidden_size % num_heads != 0:
        raise DamchaConfigError(
            f"{name}: `num_attention_heads` ({num_heads}) must divide `hidden_size` ({hidden_size}); "
            f"pick a head count that divides it, such as {_nearest_divisors(hidden_size, num_heads)}."
        )
    for field, rule in rules.items():
        if hasattr(config, field):  # a stock config checked for conversion lacks the fields; it takes the defaults
            message = rule.refusal(name, field, getattr(config, field))
            if message:
                raise DamchaConfigError(message)
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


@dataclass(repr=False, kw_only=True)
class DamchaConfigMixin:
    """The DAMCHA fields, mixed in before a stock transformers config (`class DamchaGPT2Config(DamchaConfigMixin,
    GPT2Config)`, decorated `@one_line_config_errors` over `@strict`). A family sets `model_type = "damcha_<stock model_type>"` and `damcha_causal`,
    and may override a field's default (ViT: `metric_context: str = "sequence"`)."""

    # A decoder: `metric_context="sequence"` would let it see future tokens, so it is refused.
    damcha_causal: ClassVar[bool] = True
    # What each DAMCHA field accepts (`one_line_config_errors` checks a field whenever it is set).
    damcha_field_rules: ClassVar[dict[str, FieldRule]] = METRIC_FIELD_RULES

    cross_head_variant: str = "damcha"
    dcmha_rank: int = 2
    metric_hidden_size: int = 64
    metric_context: str = "token"
    metric_mask: str = "full"
    metric_sharing: str = "stack"
    metric_form: str = "keys"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and METRIC_OPTIONS_DOCSTRING not in cls.__doc__:
            cls.__doc__ += METRIC_OPTIONS_DOCSTRING

    def validate_metric_options(self):
        check_metric_options(self, causal=self.damcha_causal, rules=self.damcha_field_rules)

    @classmethod
    def stock_model_type(cls) -> str:
        return cls.model_type.removeprefix("damcha_")

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
        (result[0] if isinstance(result, tuple) else result).validate()
        return result


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
    variant = config.cross_head_variant
    if variant == "damcha" and config.metric_form == "keys" and kv_heads == 1 and heads > 1:
        raise ValueError(
            f"{name}: `num_key_value_heads=1` (multi-query attention) leaves DAMCHA no key/value heads to mix across "
            "(`C` would be 1 x 1, a per-token rescaling of the one key, not a cross-head metric). Use a checkpoint "
            "with `num_key_value_heads` >= 2, `metric_form='scores'` (which mixes the query heads' score maps), or "
            "`cross_head_variant='none'` for the plain model."
        )
    if variant in SCORE_MIXING_VARIANT_NAMES and kv_heads != heads:
        raise ValueError(
            f"{name}: `cross_head_variant={variant!r}` mixes the score maps of all query heads, which this plugin "
            f"implements for multi-head attention only, but `num_key_value_heads` ({kv_heads}) is not "
            f"`num_attention_heads` ({heads}). Use `cross_head_variant='damcha'` or `'none'` for grouped-query "
            f"models, or set `num_key_value_heads={heads}`."
        )
