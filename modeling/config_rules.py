"""What a DAMCHA config field accepts, and the one-line error that refuses anything else.

Torch-free and standard-library only: the config files, the attention variants' declarations and the command line's
`--help` import it. Part of the remote-code payload.
"""

from collections.abc import Callable
from dataclasses import dataclass


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


def positive_int_rule(meaning: str, suggestion: str, *, none_means: str | None = None) -> FieldRule:
    """A positive integer; with `none_means`, None is accepted too and means that."""
    return FieldRule(
        accepts=lambda value: (
            (value is None and none_means is not None)
            or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        ),
        description=f"a positive integer ({meaning})" + (f", or None for {none_means}" if none_means else ""),
        fix=suggestion,
    )


def non_negative_float_rule(meaning: str, suggestion: str) -> FieldRule:
    """A finite number at or above zero (an int is accepted as the float it stands for)."""
    return FieldRule(
        accepts=lambda value: (
            isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf")
        ),
        description=f"a number at or above zero ({meaning})",
        fix=suggestion,
    )


@dataclass(frozen=True)
class ConfigField:
    """A config field an attention variant adds to every DAMCHA config: its type and default, what it accepts, its
    entry in the config's docstring (`doc`, indented as transformers' `Args:` sections are) and its flag's help."""

    type: object  # a type, or a union such as `int | None`
    default: object
    rule: FieldRule
    doc: str
    help: str  # a few words for its command-line flag
    documented_default: bool = True  # False where a family overrides the default (ViT's `metric_context`)

    @property
    def type_name(self) -> str:
        return getattr(self.type, "__name__", str(self.type))  # `int`, or a union as written: `int | None`

    def docstring(self, name: str) -> str:
        default = f", defaults to `{self.default!r}`".replace("'", '"') if self.documented_default else ""
        return f"    {name} (`{self.type_name}`, *optional*{default}):\n{self.doc.rstrip()}\n"
