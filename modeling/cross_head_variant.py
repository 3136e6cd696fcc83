"""What an attention variant declares: `CrossHeadVariant`, the interface every `variant_*.py` file implements.

A variant is one `cross_head_variant` value of the DAMCHA configs (`"damcha"`, `"talking_heads"`, `"dcmha"`,
`"colmha"`, `"moa"`, `"none"`; `variants.py` lists them): the configs take its fields, defaults and validation from
here, the models build and initialise its parameters through its hooks, the attention core
(`dispatch.cross_head_attention_inputs`) calls its attention hook, and the conversion, the model card and the command
lines read its names and descriptions.

Torch-free at import, so that the configs and the command line's `--help` read the declarations without loading the
attention core: the hooks that build modules import their torch code when called, and `bind`, called when a layer is
built, resolves once the torch code the per-call hooks run. Part of the remote-code payload.
"""

from typing import ClassVar

from .config_rules import ConfigField

# A variant that keeps every attention backend transformers dispatches to (these and any other registered one, e.g. a
# Hub kernel or a paged one) declares `ALL_BACKENDS`; one that needs particular ones names them ("eager" always runs).
ALL_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# The attributes the models give a variant's modules: one per layer stack (shared by its layers), one per layer.
STACK_MODULE, LAYER_MODULE = "cross_head_metric", "cross_head_mixing"
# The attribute an attention layer keeps its bound variant in (`CrossHeadVariant.bind`).
BOUND_VARIANT = "attention_variant"


class InexactStartWarning(UserWarning):
    """A conversion whose result no longer computes what the source did (MoA's sparse start), by the variant's design;
    filter it by this class (`warnings.filterwarnings("ignore", category=InexactStartWarning)`)."""


class CrossHeadVariant:
    """One attention variant. Subclasses set the class attributes and override the hooks their variant needs; the
    defaults describe plain multi-head attention (no parameters, every backend, nothing mixed)."""

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

    def stack_module(self, config, **layout):
        """The module one layer stack owns (`cross_head_metric`), shared by its layers; None for none. `layout`: what
        a family's stack has other than its config's defaults (`CrossHeadMetric.from_config`: BART's decoder)."""
        return None

    def layer_module(self, config):
        """The module each self-attention layer owns (`cross_head_mixing`); None for none."""
        return None

    def init_weights(self, module, std: float) -> None:
        """Called by a model's `_init_weights` for every module: start this variant's own modules as exact MHA."""

    # --- attention --------------------------------------------------------------------------------------------------

    # Whether the attention hook computes the key from `key_projection` itself when a layer passes no key (otherwise
    # the attention core projects it first).
    projects_key: ClassVar[bool] = False

    def bind(self) -> "CrossHeadVariant":
        """Resolve the torch code the per-call hooks (`attention_inputs`, `attended_key`, `attended_output`) run, once,
        when a layer of this variant is built (torch is loaded by then), so that a forward imports nothing; returns the
        variant, which the layer keeps (`dispatch.layer_variant`). Until then the declaration stays torch-free."""
        return self

    def attention_inputs(self, module, query, key, value, *, hidden_states, key_states, metric, **options):
        """The attention hook: `(query, key, score_mixing)` for the layer `module`.

        `query`, `key` `(batch, heads, seq, head_dim)` are the layer's projections (`key` is None where it comes from
        the cache already mixed); `hidden_states` the queries' tokens; `key_states` the keys' tokens (None: from the
        cache); `metric` the stack's module. `score_mixing`, if not None, mixes the `n x n` score maps in eager
        attention (`score_mixing.score_mixing_attention`); otherwise `(query, key, value)` go to the configured
        attention function as they are. `options`: `metric_context`, `token_mask`, `key_projection`, `dropout`,
        `attn_implementation`.
        """
        return query, key, None

    def attended_key(self, module, key):
        """The key the attention function gets, from `key` `(batch, heads, seq, head_dim)` as the KV cache returns it
        (the cache stores what `attention_inputs` gave). The attention core then lays the key heads side by side for a
        query wider than the key (`attention_heads.full_width_key`)."""
        return key

    def attended_output(self, module, output, hidden_states):
        """The attention output `(batch, seq, heads, head_dim)` the layer projects, from `output` as the attention
        function returns it, for the query tokens `hidden_states` (MoA gates each token's heads here)."""
        return output

    # --- the model's output (`reports_auxiliary_loss`) --------------------------------------------------------------

    def checkpointing_function(self, checkpoint, layer):
        """The gradient-checkpointing function `layer` uses, from `checkpoint`, the one transformers gives it: a
        variant whose layers record a loss makes the checkpointed function return it (MoA)."""
        return checkpoint

    def prepare_model(self, model) -> None:
        """Called on each model a built model holds (a head, and the base model inside it) once its layers are built:
        a variant whose layers record a loss registers there what reports it (MoA's forward hooks)."""

    # --- conversion -------------------------------------------------------------------------------------------------

    def after_conversion(self, model, source, caller: str = "convert_to_damcha") -> None:
        """Called once a multi-head model's weights are in `model`: by `convert_to_damcha` (`source` the model
        converted) and by `from_pretrained` of a checkpoint without this variant's weights (`source` None). A variant
        whose start is not exact MHA re-parametrises them here (ColMHA's compression) or says so (MoA's sparse start);
        `caller` names the call in a warning."""


class ScoreMixingVariant(CrossHeadVariant):
    """A variant that mixes the `n x n` score maps across heads (talking-heads, DCMHA): a per-layer module, a
    `score_mixing.ScoreMixing` with `dynamic_weights`, `mix_logits` and `mix_probabilities`, run by
    `score_mixing.score_mixing_attention` in eager attention, since no fused kernel exposes the score maps. Subclasses name their module class (`mixing_class`)."""

    grouped_query = False
    multi_head_only = "mixes the score maps of all query heads"
    parameter_kind = "cross-head mixing"

    def mixing_class(self) -> type:
        raise NotImplementedError

    def backends(self, config) -> tuple[str, ...]:
        return ("eager",)

    def backend_refusal(self, config, requested: str) -> str:
        return (
            f"`cross_head_variant={self.name!r}` mixes the attention score maps across heads, which only eager "
            f"attention materialises, so it cannot run with `attn_implementation={requested!r}`. Load or build the "
            "model with `attn_implementation='eager'` (or leave it unset), or use DAMCHA's `metric_form='keys'` or "
            "`cross_head_variant='none'`, which run on every backend."
        )

    def layer_module(self, config):
        return self.mixing_class().from_config(config)

    def bind(self) -> "ScoreMixingVariant":
        self.bound_mixing_class = self.mixing_class()
        return self

    def attention_inputs(self, module, query, key, value, *, hidden_states, key_states, metric, **options):
        mixing = getattr(module, LAYER_MODULE, None)
        # A wrapper (PEFT's modules_to_save) stands in for the module and forwards its methods to the trained copy, so
        # the check looks through it instead of insisting on the class.
        if not isinstance(getattr(mixing, "original_module", mixing), self.bound_mixing_class):
            raise ValueError(
                f"{type(module).__name__} has no `{LAYER_MODULE}` module for `cross_head_variant={self.name!r}`; "
                "build the model through its config, which gives every layer one."
            )
        return query, key, mixing
