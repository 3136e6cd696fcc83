"""Configuration of the DAMCHA ViT denoiser: a ViT that predicts the noise in a noised image (a diffusion model)."""

from huggingface_hub.dataclasses import strict

from .configuration_damcha_vit import DamchaViTConfig
from .damcha_config import FieldRule, one_line_config_errors


@one_line_config_errors
@strict
class DamchaViTDenoiserConfig(DamchaViTConfig):
    r"""
    Configuration of a [`DamchaViTDenoiserModel`]: every field of [`DamchaViTConfig`] (the ViT encoder: image and
    patch size, width, depth, heads, and the attention variant with its metric fields) plus the timestep embedding.

    The encoder is U-ViT-like: the timestep enters as a token (its embedding is added at the CLS position), every
    layer attends over it and the patches, and a linear head turns each patch token back into the predicted noise of
    its patch, so the output has the shape of `pixel_values`. The noise schedule is not part of the model: train and
    sample it with a `diffusers` scheduler (see `damcha_hf.diffusion`).

    time_embedding_size (`int`, *optional*, defaults to 256):
        Width of the sinusoidal features of the timestep, which an MLP (`time_embedding_size -> hidden_size ->
        hidden_size`, SiLU) turns into the time token.
    time_max_period (`float`, *optional*, defaults to 10000.0):
        The longest period of the sinusoidal features, in timesteps; the shortest is 1 (as in DDPM, DiT and U-ViT).
    """

    model_type = "damcha_vit_denoiser"
    damcha_field_rules = {
        **DamchaViTConfig.damcha_field_rules,
        "time_embedding_size": FieldRule(
            accepts=lambda size: isinstance(size, int) and not isinstance(size, bool) and size >= 2 and size % 2 == 0,
            description="an even integer of at least 2 (half cosines, half sines)",
            fix="256 is a good default",
        ),
        "time_max_period": FieldRule(
            accepts=lambda period: isinstance(period, int | float) and not isinstance(period, bool) and period > 1,
            description="a number above 1 (the longest period of the timestep features, in timesteps)",
            fix="10000 is the usual choice",
        ),
    }

    time_embedding_size: int = 256
    time_max_period: float | int = 10000.0


__all__ = ["DamchaViTDenoiserConfig"]
