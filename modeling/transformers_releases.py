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


def release_tuple(version: str) -> tuple[int, ...]:
    """`"5.16.1"` -> `(5, 16, 1)`; a part that is not a plain number (`"0.dev0"`, `"0rc1"`) ends the tuple there, so
    that a pre-release is not taken for the release it precedes."""
    parts = []
    for part in version.split(".")[:3]:
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def warn_if_untested_transformers(version: str = transformers.__version__) -> bool:
    """Warn once when transformers is outside the range the releases CI runs span (setup.cfg's range). A pip install
    of the plugin keeps to it, but a checkpoint's remote code runs on whatever transformers its user has. Returns
    whether it warned."""
    release = release_tuple(version)
    oldest, newest = release_tuple(TESTED_TRANSFORMERS[0]), release_tuple(TESTED_TRANSFORMERS[-1])
    # From the oldest tested release itself (setup.cfg's lower bound) to any patch of the newest tested minor version.
    if len(release) == 3 and oldest <= release and release[:2] <= newest[:2]:
        return False
    warnings.warn(
        f"DAMCHA models are tested with transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[-1]}, and this "
        f"is transformers {version}: the attention internals they extend change between releases. If outputs or "
        f"generation look wrong, install a tested release (`pip install 'transformers=={TESTED_TRANSFORMERS[-1]}'`).",
        stacklevel=2,
    )
    return True


warn_if_untested_transformers()


def register_output_recording(model: torch.nn.Module) -> None:
    """Register a model whose class changed after `PreTrainedModel.__init__` for transformers' output recording
    (`output_attentions`, `output_hidden_states`), which looks up what to record by the model's class name.

    The registry takes the model itself where it is a mapping of its own (5.25: it keys the entry by the model's
    class), and the class name where it is a plain dict (5.22 and before)."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    keyed_by_model = type(_CAN_RECORD_REGISTRY).__setitem__ is not dict.__setitem__
    _CAN_RECORD_REGISTRY[model if keyed_by_model else str(model.__class__)] = model._can_record_outputs


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
