"""What an attention variant declares: `CrossHeadVariant`, the interface every `variant_*.py` file implements.

A variant is one `cross_head_variant` value of the DAMCHA configs (`variants.py` lists them) and two parts: this
declaration (its names, config fields, backends, refusals, and the factory of its module) and its module, a
`attention_heads.CrossHeadModule` in a torch file of its own, which does what the variant does at each attention call
(`attention_inputs`, `attended_key`, `attended_output`) and in the model around it (MoA's loss). The configs take the
declaration's fields, defaults and validation, the models build its module through it, the attention core
(`dispatch.cross_head_attention_inputs`) calls the module, and the conversion, the model card and the command lines
read its names and descriptions.

Torch-free at import, so that the configs and the command line's `--help` read the declarations without loading the
attention core: `module_class` imports the torch code when a model is built. Part of the remote-code payload.
"""

from typing import ClassVar

from .config_rules import ConfigField

# A variant that keeps every attention backend transformers dispatches to (these and any other registered one, e.g. a
# Hub kernel or a paged one) declares `ALL_BACKENDS`; one that needs particular ones names them ("eager" always runs).
ALL_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# The attributes the models give a variant's modules: one per layer stack (shared by its layers), one per layer.
STACK_MODULE, LAYER_MODULE = "cross_head_metric", "cross_head_mixing"
# The attribute an attention layer keeps its variant's declaration in, set when the layer is built.
BOUND_VARIANT = "attention_variant"


class InexactStartWarning(UserWarning):
    """A conversion whose result no longer computes what the source did (MoA's sparse start), by the variant's design;
    filter it by this class (`warnings.filterwarnings("ignore", category=InexactStartWarning)`)."""


class CrossHeadVariant:
    """One attention variant's declaration. Subclasses set the class attributes and override the methods their variant
    needs; the defaults describe plain multi-head attention (no module, every backend, nothing mixed)."""

    name: ClassVar[str]  # the `cross_head_variant` value
    display_name: ClassVar[str]  # a table's row name: "DAMCHA", "DCMHA"
    summary: ClassVar[str]  # a few words for `--help`: "static H x H mixing of the score maps"
    description: ClassVar[str]  # what the model card says the attention is
    config_doc: ClassVar[str]  # its clause in the docstring of `cross_head_variant`
    reference: ClassVar[str] = ""  # the paper it follows
    fields: ClassVar[dict[str, ConfigField]] = {}  # the config fields it adds
    parameter_kind: ClassVar[str] = (
        "cross-head"  # its added parameters, as a card and an error name them: "<kind> weights"
    )
    # Why it keeps fewer backends than `ALL_BACKENDS`, where it does (the refusal of another backend says it).
    backend_reason: ClassVar[str] = "needs particular attention backends"
    # Whether it runs with grouped-query attention (fewer key/value heads than query heads), and if not, why not.
    grouped_query: ClassVar[bool] = True
    multi_head_only: ClassVar[str] = ""
    # Whether its layers record a loss that the model reports as `aux_loss` and adds to `loss` (MoA's load balancing).
    reports_auxiliary_loss: ClassVar[bool] = False
    # Where its module lives: `STACK_MODULE` (one per layer stack, shared by its layers: DAMCHA's metric generator),
    # `LAYER_MODULE` (one per self-attention layer) or None (no module: plain attention).
    module_place: ClassVar[str | None] = None
    # Why vLLM cannot serve it ("": it can), and whether it keeps working with its heads split across devices
    # (tensor parallelism) and its layers across stages (pipeline parallelism).
    unservable_reason: ClassVar[str] = ""
    serves_split_heads: ClassVar[bool] = True

    # --- the config -------------------------------------------------------------------------------------------------

    def backends(self, config) -> tuple[str, ...]:
        """The attention backends `config` can run on: `ALL_BACKENDS` for any; `("eager",)` makes eager the default."""
        return ALL_BACKENDS

    def backend_refusal(self, config, requested: str) -> str:
        """Why `config` cannot run on the backend `requested` (`backend_reason`), and the fix."""
        return (
            f"`cross_head_variant={self.name!r}` {self.backend_reason}, so it runs only with `attn_implementation` "
            f"{' or '.join(map(repr, self.backends(config)))}, not {requested!r}; load or build the model with one of "
            "them (or leave it unset), or use `cross_head_variant='damcha'` or `'none'`, which run on every backend."
        )

    def check_backend_of_built_model(self, config, allowed: tuple[str, ...]) -> None:
        """Refuse `config._attn_implementation` where `allowed` does not take it: a backend set on a built model, past
        the model's own check (`dispatch.attn_implementation_for`), is seen only when a layer runs."""
        requested = config._attn_implementation
        if requested not in (None, *allowed):
            raise ValueError(self.backend_refusal(config, requested))

    def config_refusal(self, config) -> str | None:
        """Why `config`'s fields do not fit together for this variant (one line naming the field and the fix), or None.
        Each field on its own was checked against its rule already."""
        return None

    def exact_start_fields(self, config) -> dict:
        """Values of its own fields with which a fresh or converted layer of `config` starts as exactly multi-head
        attention, where its defaults do not ({}: they do)."""
        return {}

    def head_layout_refusal(self, config, heads: int, key_value_heads: int) -> str | None:
        """Why `config` cannot run with `heads` query and `key_value_heads` key/value heads, or None."""
        if self.grouped_query or key_value_heads == heads:
            return None
        name = type(config).__name__
        return (
            f"{name}: `cross_head_variant={self.name!r}` {self.multi_head_only}, which this plugin "
            f"implements for multi-head attention only, but `num_key_value_heads` ({key_value_heads}) is not "
            f"`num_attention_heads` ({heads}). Use `cross_head_variant='damcha'` or `'none'` for grouped-query "
            f"models, or set `num_key_value_heads={heads}`."
        )

    # --- the model's modules ----------------------------------------------------------------------------------------

    def module_class(self) -> type | None:
        """Its module's class (a `CrossHeadModule` with a `from_config` classmethod), imported when called; None for
        none."""
        return None

    def stack_module(self, config, **layout):
        """The module one layer stack owns (`cross_head_metric`), shared by its layers; None for none. `layout`: what
        a family's stack has other than its config's defaults (`CrossHeadMetric.from_config`: BART's decoder)."""
        return self.module_class().from_config(config, **layout) if self.module_place == STACK_MODULE else None

    def layer_module(self, config):
        """The module each self-attention layer owns (`cross_head_mixing`); None for none."""
        return self.module_class().from_config(config) if self.module_place == LAYER_MODULE else None

    def missing_module_refusal(self, layer) -> str:
        """Why `layer` cannot run: its variant's module is not where the declaration says it lives."""
        if self.module_place == STACK_MODULE:
            return (
                f"{type(layer).__name__}: `cross_head_variant={self.name!r}` needs the model's `{STACK_MODULE}`; call "
                "the layer through its model, which passes it."
            )
        return (
            f"{type(layer).__name__} has no `{LAYER_MODULE}` module for `cross_head_variant={self.name!r}`; build the "
            "model through its config, which gives every layer one."
        )

    def init_weights(self, module, std: float) -> None:
        """Called by a model's `_init_weights` for every module: start this variant's own modules as exact MHA."""

    # --- serving ----------------------------------------------------------------------------------------------------

    def serving_refusal(self, config) -> str | None:
        """Why vLLM cannot serve `config` ("vLLM cannot serve <setting>: <reason>", from `unservable_reason` or its
        fields), or None where it can."""
        if self.unservable_reason:
            return f"vLLM cannot serve `cross_head_variant={self.name!r}`: it {self.unservable_reason}"
        return None

    # --- conversion -------------------------------------------------------------------------------------------------

    def after_conversion(self, model, source, caller: str = "convert_to_damcha") -> None:
        """Called once a multi-head model's weights are in `model`: by `convert_to_damcha` (`source` the model
        converted) and by `from_pretrained` of a checkpoint without this variant's weights (`source` None). A variant
        whose start is not exact MHA re-parametrises them here (ColMHA's compression) or says so (MoA's sparse start);
        `caller` names the call in a warning."""


class ScoreMixingVariant(CrossHeadVariant):
    """A variant that mixes the `n x n` score maps across heads (talking-heads, DCMHA): a per-layer module, a
    `score_mixing.ScoreMixing` with `dynamic_weights`, `mix_logits` and `mix_probabilities`, run by
    `score_mixing.score_mixing_attention` in eager attention, since no fused kernel exposes the score maps."""

    grouped_query = False
    multi_head_only = "mixes the score maps of all query heads"
    parameter_kind = "cross-head mixing"
    module_place = LAYER_MODULE
    unservable_reason = "mixes the attention score maps across heads, which vLLM's paged kernels never form"

    def backends(self, config) -> tuple[str, ...]:
        return ("eager",)

    def backend_refusal(self, config, requested: str) -> str:
        return (
            f"`cross_head_variant={self.name!r}` mixes the attention score maps across heads, which only eager "
            f"attention materialises, so it cannot run with `attn_implementation={requested!r}`. Load or build the "
            "model with `attn_implementation='eager'` (or leave it unset), or use DAMCHA's `metric_form='keys'` or "
            "`cross_head_variant='none'`, which run on every backend."
        )
