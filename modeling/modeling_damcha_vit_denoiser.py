"""The DAMCHA ViT denoiser: a diffusion model's noise predictor built on the DAMCHA ViT encoder (U-ViT-like).

`DamchaViTDenoiserModel(noisy_images, timestep)` predicts the noise that a diffusion scheduler added to the images.
Its encoder is a `DamchaViTModel` (the ViT patch embeddings and layers, with the attention the config selects:
DAMCHA, talking-heads, DCMHA or plain multi-head attention), converted at `post_init` like every DAMCHA model. The
timestep enters as a token: a sinusoidal embedding and an MLP give a vector that is added at the CLS position, so every
layer attends over the time token and the patches (U-ViT's time token, without its long skip connections); a linear
head maps each output patch token back to the noise of its patch. The head starts at zero (as DiT's does), so a fresh
model predicts no noise.

The noise schedule lives outside the model (diffusers' schedulers, `damcha_hf.diffusion`).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.vit.modeling_vit import ViTModel
from transformers.utils import ModelOutput

from .configuration_damcha_vit import _pair
from .configuration_damcha_vit_denoiser import DamchaViTDenoiserConfig
from .damcha_family import DamchaFamily, DamchaHead
from .modeling_damcha_vit import DamchaViTPreTrainedModel, check_pixel_values


@dataclass
class DamchaViTDenoiserOutput(ModelOutput):
    """`sample`: the predicted noise, shaped like `pixel_values` (named as diffusers' models name their output);
    `loss`: the mean squared error against `labels` (the true noise), when given."""

    loss: torch.Tensor | None = None
    sample: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def sinusoidal_timestep_features(timestep: torch.Tensor, size: int, max_period: float) -> torch.Tensor:
    """`(batch, size)`: cosines then sines of `timestep` at `size / 2` frequencies spaced geometrically from 1 to
    `1 / max_period` (the Transformer's position encoding, applied to the diffusion step)."""
    half = size // 2
    exponents = torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    frequencies = torch.exp(-math.log(max_period) * exponents)
    angles = timestep.float()[:, None] * frequencies[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """Timestep -> a `hidden_size` vector: sinusoidal features, then `Linear -> SiLU -> Linear`."""

    def __init__(self, config: DamchaViTDenoiserConfig):
        super().__init__()
        self.feature_size, self.max_period = config.time_embedding_size, config.time_max_period
        self.fc_in = nn.Linear(config.time_embedding_size, config.hidden_size)
        self.activation = nn.SiLU()
        self.fc_out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        features = sinusoidal_timestep_features(timestep, self.feature_size, self.max_period)
        return self.fc_out(self.activation(self.fc_in(features.to(self.fc_in.weight.dtype))))


class NoiseHead(nn.Linear):
    """Patch token -> the predicted noise of its patch (`patch_height * patch_width * num_channels` values); starts at
    zero (`_init_weights`)."""


class DamchaViTDenoiserModel(DamchaViTPreTrainedModel):
    config_class = DamchaViTDenoiserConfig
    config: DamchaViTDenoiserConfig
    main_input_name = "pixel_values"

    def __init__(self, config: DamchaViTDenoiserConfig):
        super().__init__(config)
        # A stock ViT encoder, turned into `DamchaViTModel` (the config's attention) by `post_init`.
        self.vit = ViTModel(config, add_pooling_layer=False)
        self.time_embedding = TimestepEmbedding(config)
        patch_height, patch_width = _pair(config.patch_size)
        self.noise_head = NoiseHead(config.hidden_size, patch_height * patch_width * config.num_channels)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, NoiseHead):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        pixel_values: torch.Tensor,
        timestep: torch.Tensor | float | int,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs,
    ) -> DamchaViTDenoiserOutput:
        r"""
        pixel_values (`torch.Tensor` of shape `(batch_size, num_channels, height, width)`):
            The noised images `x_t` (scaled as the model was trained, e.g. to [-1, 1]).
        timestep (`torch.Tensor` of shape `(batch_size,)`, or a number):
            The diffusion step of each image (one number: the same step for the whole batch).
        labels (`torch.Tensor`, shaped like `pixel_values`, *optional*):
            The noise that was added; gives `loss`, the mean squared error of the prediction.
        """
        check_pixel_values(self.config, pixel_values, interpolate_pos_encoding)
        batch, _, height, width = pixel_values.shape
        timestep = torch.as_tensor(timestep, device=pixel_values.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(batch)
        if timestep.shape != (batch,):
            raise ValueError(
                f"`timestep` must be one number or a (batch_size,) tensor, one step per image, got shape "
                f"{tuple(timestep.shape)} for a batch of {batch}."
            )
        time_token = self.time_embedding(timestep)

        def add_time_token(module, args, embeddings):
            # The CLS position carries the time token; the patches keep their embeddings.
            cls_and_time = embeddings[:, :1] + time_token[:, None].to(embeddings.dtype)
            return torch.cat([cls_and_time, embeddings[:, 1:]], dim=1)

        # ViT's own forward (the pixel checks, the layer stack, the metric passed down, output recording) runs as in
        # every DAMCHA ViT; only its embedding output gains the time token.
        hook = self.vit.embeddings.register_forward_hook(add_time_token)
        try:
            outputs = self.vit(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
        finally:
            hook.remove()
        patch_height, patch_width = _pair(self.config.patch_size)
        rows, columns = height // patch_height, width // patch_width
        patches = self.noise_head(outputs.last_hidden_state[:, 1:])
        # (batch, rows * columns, patch_height * patch_width * channels) -> (batch, channels, height, width)
        sample = (
            patches.reshape(batch, rows, columns, patch_height, patch_width, self.config.num_channels)
            .permute(0, 5, 1, 3, 2, 4)
            .reshape(batch, self.config.num_channels, height, width)
        )
        loss = nn.functional.mse_loss(sample.float(), labels.float()) if labels is not None else None
        return DamchaViTDenoiserOutput(
            loss=loss, sample=sample, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


DAMCHA_FAMILY = DamchaFamily(
    model_type="vit_denoiser",
    display_name="ViT denoiser",
    config_class=DamchaViTDenoiserConfig,
    heads=(DamchaHead("AutoModel", DamchaViTDenoiserModel, None, "unconditional-image-generation"),),
    vision=True,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"),
    task_head_modules=("noise_head", "time_embedding"),
)


__all__ = DAMCHA_FAMILY.exports(DamchaViTDenoiserOutput)
