"""DAMCHA ViT: the Vision Transformer whose self-attention scores with the cross-head metric of `metric.py`.

Only the self-attention changes; patch embeddings, MLPs, the classifier and every weight name are ViT's, so every ViT
checkpoint loads with all weights kept and (the metric generator starting at zero) identical outputs.

Every class inherits its stock class's `__init__` and `forward` (see `damcha_pretrained.py`); the base model checks its
`pixel_values` and passes the metric down before ViT's own `forward`. It relies on ViT's attention internals
(`ViTAttention` with `q_proj/k_proj/v_proj/o_proj`, `ALL_ATTENTION_FUNCTIONS`, output recording, the "ViTModel"
checkpoint conversion mapping).
"""

import functools

import torch
from torch import nn
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.vit.modeling_vit import (
    ViTAttention,
    ViTForImageClassification,
    ViTForMaskedImageModeling,
    ViTModel,
    ViTPreTrainedModel,
    eager_attention_forward,
)

from .attention_heads import attended_tokens, project_heads
from .configuration_damcha_vit import DamchaViTConfig, _pair
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaAttentionMixin, DamchaPreTrainedMixin
from .dispatch import cross_head_attention_inputs, cross_head_attention_output


class DamchaViTAttention(DamchaAttentionMixin, ViTAttention):
    """ViT self-attention with DAMCHA's cross-head metric; the metric comes in as `cross_head_metric`.

    A variant with a per-layer module (talking-heads, DCMHA) gives the layer its `cross_head_mixing`.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cross_head_metric: nn.Module | None = None,
        token_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`token_mask` `(batch, seq)`: True for the tokens `"sequence"` averages over (the unpadded ones)."""
        query, value = (
            project_heads(projection, hidden_states, self.head_dim) for projection in (self.q_proj, self.v_proj)
        )
        # The core projects the key: `"sequence"` and `"token"` project and mix it in one step that keeps less for
        # backward.
        dropout = self.attention_dropout if self.training else 0.0
        query, key, value, eager_attention = cross_head_attention_inputs(
            self,
            hidden_states,
            query,
            None,
            value,
            key_projection=self.k_proj,
            metric=cross_head_metric,
            default_attention=eager_attention_forward,
            dropout=dropout,
            token_mask=token_mask,
            **kwargs,
        )
        # The lookup and its one call stay in this `forward`, as in the stock layer: see `cross_head_attention_inputs`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        attn_output = cross_head_attention_output(self, attn_output, hidden_states)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DamchaViTPreTrainedModel(DamchaPreTrainedMixin, ViTPreTrainedModel):
    config_class = DamchaViTConfig
    config: DamchaViTConfig
    damcha_attention_class = DamchaViTAttention


def check_pixel_values(config: DamchaViTConfig, pixel_values, interpolate_pos_encoding: bool | None) -> None:
    """Refuse images the model cannot embed, with the config field and the fix (ViT's own errors name neither)."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4:
        got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise ValueError(
            f"`pixel_values` must be a (batch, num_channels, height, width) tensor, got {got}; prepare images with "
            "ViTImageProcessor(...)(images, return_tensors='pt').pixel_values."
        )
    channels, height, width = pixel_values.shape[1:]
    if channels != config.num_channels:
        raise ValueError(
            f"`pixel_values` has {channels} channels but the config's `num_channels` is {config.num_channels}; "
            f"convert the images to {config.num_channels} channel(s) (ViTImageProcessor with a "
            f"{config.num_channels}-value `image_mean`/`image_std`, or `do_convert_rgb=True` for 3), or build the "
            f"model with `num_channels={channels}`."
        )
    image_height, image_width = _pair(config.image_size)
    patch_height, patch_width = _pair(config.patch_size)
    if interpolate_pos_encoding:
        if height % patch_height or width % patch_width:
            raise ValueError(
                f"`pixel_values` is {height}x{width}, not a multiple of `patch_size` ({config.patch_size!r}); "
                "resize or crop the images to a multiple of it."
            )
    elif (height, width) != (image_height, image_width):
        raise ValueError(
            f"`pixel_values` is {height}x{width} but the config's `image_size` is {image_height}x{image_width}; "
            f"resize the images to it (ViTImageProcessor `size={{'height': {image_height}, 'width': {image_width}}}`) "
            "or pass `interpolate_pos_encoding=True` to interpolate the position embeddings."
        )


class DamchaViTModel(DamchaViTPreTrainedModel, ViTModel):
    damcha_layer_stack = True

    @functools.wraps(ViTModel.forward)
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        check_pixel_values(self.config, pixel_values, interpolate_pos_encoding)
        sequence_metric = self.config.cross_head_variant == "damcha" and self.config.metric_context == "sequence"
        if sequence_metric and attention_mask is not None:
            # `"sequence"` takes its metric from the mean over the tokens the mask keeps (padding leaves it unchanged).
            kwargs["token_mask"] = attended_tokens(attention_mask)
        # Passes the stack's metric down as `forward_with_cross_head_metric` does (see there why), after ViT's checks.
        return ViTModel.forward(
            self,
            pixel_values,
            bool_masked_pos=bool_masked_pos,
            interpolate_pos_encoding=interpolate_pos_encoding,
            attention_mask=attention_mask,
            cross_head_metric=self.cross_head_metric,
            **kwargs,
        )


class DamchaViTForImageClassification(DamchaViTPreTrainedModel, ViTForImageClassification):
    pass


class DamchaViTForMaskedImageModeling(DamchaViTPreTrainedModel, ViTForMaskedImageModeling):
    """ViT with the SimMIM decoder for masked image modelling (`bool_masked_pos`); needs `encoder_stride` equal to
    `patch_size` when masking, as the stock class does."""


# Checkpoints saved before transformers 5 (and ViT checkpoints that transformers 5 still writes) name the weights
# `encoder.layer.N.attention.attention.query`, ...; transformers renames them on load through the mapping registered
# for "ViTModel", but skips it for a class defined outside transformers unless that class registers its own.
register_checkpoint_conversion_mapping(
    DamchaViTModel.__name__, get_checkpoint_conversion_mapping(ViTModel.__name__), overwrite=True
)


def vit_architecture_options(model) -> dict:
    """A `ViTModel`'s pooler and mask token are constructor options: the converted model must have the same ones."""
    if isinstance(model, ViTModel):
        return {
            "add_pooling_layer": model.pooler is not None,
            "use_mask_token": model.embeddings.mask_token is not None,
        }
    return {}


DAMCHA_FAMILY = DamchaFamily(
    model_type="vit",
    display_name="ViT",
    config_class=DamchaViTConfig,
    heads=(
        DamchaHead("AutoModel", DamchaViTModel, ViTModel),
        DamchaHead(
            "AutoModelForImageClassification",
            DamchaViTForImageClassification,
            ViTForImageClassification,
            "image-classification",
        ),
        DamchaHead(
            "AutoModelForMaskedImageModeling",
            DamchaViTForMaskedImageModeling,
            ViTForMaskedImageModeling,
            "image-feature-extraction",
        ),
    ),
    vision=True,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"),
    task_head_modules=("classifier",),  # a new dataset's classifier starts fresh: train it in full
    architecture_options=vit_architecture_options,
)


__all__ = DAMCHA_FAMILY.exports(DamchaViTPreTrainedModel)
