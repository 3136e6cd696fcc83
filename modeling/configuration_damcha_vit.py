"""Configuration of DAMCHA ViT: the Vision Transformer with data-adaptive cross-head metric attention."""

from collections.abc import Iterable

from huggingface_hub.dataclasses import strict
from transformers import ViTConfig

from .damcha_config import DamchaConfigMixin, one_line_config_errors


def _pair(size) -> tuple[int, int]:
    return tuple(size) if isinstance(size, Iterable) else (size, size)


@one_line_config_errors
@strict
class DamchaViTConfig(DamchaConfigMixin, ViTConfig):
    r"""
    Configuration of a [`DamchaViTModel`]: every field of [`ViTConfig`] plus the DAMCHA metric fields below. Any ViT
    `config.json` loads into it, with the metric fields at their defaults. `metric_context` defaults to `"sequence"`:
    one cross-head matrix `C` per image, from the mean normalised hidden state over its tokens (the patches and the
    CLS token; with an `attention_mask`, over the tokens it keeps, so padding leaves `C` unchanged). `"token"` and
    `"query"` work too, bidirectionally.

    Stricter than [`ViTConfig`], deliberately: `num_attention_heads` must divide `hidden_size` (stock ViT accepts
    e.g. `hidden_size=32` with its default 12 heads and then runs 16 heads of width 2, whatever the config says, since
    its attention reshapes by `hidden_size // num_attention_heads`), because `C` is `num_attention_heads` x
    `num_attention_heads` and mixes exactly that many heads; the error names the nearest head counts that divide. And
    `image_size` must be a multiple of `patch_size` (per side, when either is a pair), where stock ViT silently drops
    the last pixels.

    Presets: [`DamchaViTConfig.vit_small_patch16_224`] (ViT-S/16, the shape the paper trains on ImageNet-1K).
    """

    model_type = "damcha_vit"
    damcha_causal = False

    metric_context: str = "sequence"

    def validate_patch_grid(self):
        image_size, patch_size = _pair(self.image_size), _pair(self.patch_size)
        if len(image_size) != 2 or len(patch_size) != 2:
            raise ValueError(
                f"{type(self).__name__}: `image_size` ({self.image_size!r}) and `patch_size` ({self.patch_size!r}) "
                "must each be an int or a (height, width) pair."
            )
        if any(patch <= 0 or image % patch != 0 for image, patch in zip(image_size, patch_size)):
            raise ValueError(
                f"{type(self).__name__}: `image_size` ({self.image_size!r}) must be divisible by `patch_size` "
                f"({self.patch_size!r}), or the last row and column of pixels would be silently dropped; pick an "
                "`image_size` that is a multiple of `patch_size` (and resize the images to it, e.g. with "
                "ViTImageProcessor's `size`)."
            )

    @classmethod
    def vit_small_patch16_224(cls, **overrides) -> "DamchaViTConfig":
        """ViT-S/16 at 224x224, the shape the paper trains on ImageNet-1K.

        Width 384, 12 layers, 6 heads (head width 64), MLP 1536, 16x16 patches (196 patches plus CLS). Any field can
        be overridden, e.g. `DamchaViTConfig.vit_small_patch16_224(num_labels=1000, metric_context="token")`.
        With the defaults (`metric_hidden_size=64`, one generator per stack) and a 1000-class head, the metric
        generator has 26,980 parameters, 0.122% of the 22,077,644 of `DamchaViTForImageClassification`
        (`damcha-hf info vit-small` prints these).
        """
        shape = {
            "hidden_size": 384,
            "num_hidden_layers": 12,
            "num_attention_heads": 6,
            "intermediate_size": 1536,
            "image_size": 224,
            "patch_size": 16,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "vit-small": {
        "head": "DamchaViTForImageClassification",
        "config": "vit_small_patch16_224",
        "overrides": {"num_labels": 1000},
        "about": "ViT-S/16, 224px, 1000 classes",
    }
}

__all__ = ["DamchaViTConfig"]
