"""The attention variants, one `variant_*.py` file each: the one table every reader of `cross_head_variant` uses.

The configs take each variant's fields from here (`variant_config_fields`), the models its module (`variant_of`), the
command lines and the model card its names and descriptions. A new variant is one `variant_<name>.py` file (a
`CrossHeadVariant`; see `cross_head_variant.py`), its module's file if it has one, and one line below. Torch-free at
import.
Part of the remote-code payload: a saved checkpoint's copy of this file imports only the variant it was saved with and
plain attention (`checkpoint_code.py` writes it), so that the checkpoint carries no other variant's code.
"""

from dataclasses import dataclass
from types import SimpleNamespace

from .config_rules import ConfigField, FieldRule, choice_rule
from .cross_head_variant import CrossHeadVariant
from .variant_colmha import VARIANT as COLMHA
from .variant_damcha import VARIANT as DAMCHA
from .variant_dcmha import VARIANT as DCMHA
from .variant_mha import VARIANT as MHA
from .variant_moa import VARIANT as MOA
from .variant_talking_heads import VARIANT as TALKING_HEADS

# In the order the command line lists them; the first is the configs' default.
VARIANTS: dict[str, CrossHeadVariant] = {
    variant.name: variant for variant in (DAMCHA, TALKING_HEADS, DCMHA, COLMHA, MOA, MHA)
}
CROSS_HEAD_VARIANTS = tuple(VARIANTS)
DEFAULT_VARIANT = CROSS_HEAD_VARIANTS[0]
# Every variant the plugin has, by name. A checkpoint's copy of this file lists them as plain names, so that its configs
# can tell a variant whose code the checkpoint does not carry from a misspelt one.
PLUGIN_VARIANTS = CROSS_HEAD_VARIANTS


def variant_of(config) -> CrossHeadVariant:
    """The variant `config.cross_head_variant` names (a stock config, which has no such field, is plain attention)."""
    return VARIANTS[getattr(config, "cross_head_variant", MHA.name)]


@dataclass(frozen=True)
class VariantRule(FieldRule):
    """`cross_head_variant`'s rule: one of `CROSS_HEAD_VARIANTS`; a variant of the plugin that this copy of the code
    does not carry (a saved checkpoint carries its own only) is refused as such."""

    def refusal(self, config_name: str, field: str, value) -> str | None:
        if isinstance(value, str) and value in PLUGIN_VARIANTS and value not in VARIANTS:
            return (
                f"{config_name}: `{field}={value!r}` is not in this checkpoint's code, which carries only "
                f"{' and '.join(map(repr, CROSS_HEAD_VARIANTS))} (a saved checkpoint ships the code of its own "
                "variant); to switch variants, `import damcha_hf` and load the checkpoint without `trust_remote_code`."
            )
        return super().refusal(config_name, field, value)


def variant_rule() -> VariantRule:
    """What `cross_head_variant` accepts: a variant this code carries."""
    choices = choice_rule(CROSS_HEAD_VARIANTS)
    return VariantRule(choices.accepts, choices.description, choices.fix, choices.choices)


def variant_config_fields() -> dict[str, ConfigField]:
    """Every variant's own config fields, in table order; two variants never declare the same field."""
    fields: dict[str, ConfigField] = {}
    for variant in VARIANTS.values():
        clash = fields.keys() & variant.fields.keys()
        if clash:
            raise TypeError(f"variant {variant.name!r} declares {sorted(clash)}, which another variant declares")
        fields.update(variant.fields)
    return fields


def backends_of(name: str, **fields) -> tuple[str, ...]:
    """The attention backends variant `name` runs on with the config fields `fields` (None or absent: the defaults),
    for a command line that resolves `--attn` before any config exists."""
    values = {field: spec.default for field, spec in variant_config_fields().items()}
    values.update({field: value for field, value in fields.items() if value is not None})
    return VARIANTS[name].backends(SimpleNamespace(**values))


def eager_only_variants() -> tuple[str, ...]:
    """The variants that run only in eager attention at their defaults (the score-mixing baselines)."""
    return tuple(name for name in VARIANTS if backends_of(name) == ("eager",))


def variants_help() -> str:
    """`--cross-head-variant`'s help: each name and what it is."""
    return "; ".join(f"{name}: {variant.summary}" for name, variant in VARIANTS.items())
