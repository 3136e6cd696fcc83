"""What ties the DAMCHA models to the transformers releases they run on: the warning on an untested release (given once,
when the models are imported) and the adaptor to transformers' KV caches (`EncoderDecoderCache`'s self- and
cross-attention parts).

This file imports only torch, transformers and its siblings: it is part of the remote-code payload (`dispatch.py` imports it,
so `save_pretrained` copies it with the model code).
"""

import warnings

import torch
import transformers
from transformers.cache_utils import EncoderDecoderCache

from .damcha_config import TESTED_TRANSFORMERS


def warn_if_untested_transformers(version: str = transformers.__version__) -> bool:
    """Warn once when transformers is outside the releases CI runs. A pip install of the plugin keeps to them, but a
    checkpoint's remote code runs on whatever transformers its user has. Returns whether it warned."""
    minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    tested = [tuple(int(part) for part in release.split(".")[:2]) for release in TESTED_TRANSFORMERS]
    if len(minor) == 2 and min(tested) <= minor <= max(tested):
        return False
    warnings.warn(
        f"DAMCHA models are tested with transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[-1]}, and this "
        f"is transformers {version}: the attention internals they extend change between releases. If outputs or "
        f"generation look wrong, install a tested release (`pip install 'transformers=={TESTED_TRANSFORMERS[-1]}'`).",
        stacklevel=2,
    )
    return True


warn_if_untested_transformers()


def self_attention_cache(cache):
    """The cache the self-attention layers update: an `EncoderDecoderCache` (a decoder with cross-attention, e.g.
    GPT-2 with `add_cross_attention=True`) holds it as `.self_attention_cache`, as stock GPT-2 reads it."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


class SourceKeyCache:
    """A cross-attention layer's part of an `EncoderDecoderCache`: the source's keys and values, mixed and with any
    key-side weights, are computed at the first decoding step and read back at every later one (as stock
    encoder-decoders read theirs: `is_updated` marks the layer done)."""

    def __init__(self, cache: EncoderDecoderCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx

    @staticmethod
    def of(cache, layer_idx: int) -> "SourceKeyCache | None":
        return SourceKeyCache(cache, layer_idx) if isinstance(cache, EncoderDecoderCache) else None

    @property
    def filled(self) -> bool:
        return bool(self.cache.is_updated.get(self.layer_idx))

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.cross_attention_cache.layers[self.layer_idx]
        return layer.keys, layer.values

    def update(self, key, value, layer_idx, kwargs=None):
        key, value = self.cache.cross_attention_cache.update(key, value, layer_idx)
        self.cache.is_updated[layer_idx] = True
        return key, value


def cross_attention_source_cached(cache, layer_idx: int) -> bool:
    """Whether a cross-attention layer finds its source's keys and values in `cache` (then it need not project them)."""
    source_cache = SourceKeyCache.of(cache, layer_idx)
    return source_cache is not None and source_cache.filled
