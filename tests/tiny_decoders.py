"""Tiny stock configs of the rotary decoder families (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2), for every test file.

Each keeps its family's details switched on and small enough to matter in a 9-token batch: 4 query heads sharing 2
key/value heads (grouped-query attention), a sliding window of 4 positions, and the family's own (Qwen2's q/k/v
biases, Qwen3's q/k norms and explicit head width, Phi-3's fused projection and partial rotation, Gemma 2's soft-cap,
`query_pre_attn_scalar` and alternating local and global layers).
"""

import transformers

WINDOW = 4
TINY_DECODER = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# Qwen2 and Qwen3 slide the window on the layers from `max_window_layers` on: layer 0 global, layer 1 local.
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}

STOCK_CONFIGS = {
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2": (transformers.Qwen2Config, QWEN_WINDOW),
    "qwen3": (transformers.Qwen3Config, {**QWEN_WINDOW, "head_dim": 16}),
    # A partial rotation (half of each head rotated), as Phi-3-small and Phi-4-mini use.
    "phi3": (transformers.Phi3Config, {"sliding_window": WINDOW, "partial_rotary_factor": 0.5, "resid_pdrop": 0.0}),
    # Logits of order one (a wide init), so that a soft-cap of 1 bends them; a scale from query_pre_attn_scalar that is
    # not the head width's.
    "gemma2": (
        transformers.Gemma2Config,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.0,
            "sliding_window": WINDOW,
            "initializer_range": 0.5,
            "hidden_activation": "gelu_pytorch_tanh",
            # Eager, where stock Gemma 2 soft-caps on every release: before transformers 5.22 it defaulted to SDPA,
            # which drops the cap (the DAMCHA model refuses SDPA on every release).
            "attn_implementation": "eager",
        },
    ),
}


def tiny_stock_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    config_class, family_fields = STOCK_CONFIGS[model_type]
    return config_class(**{**TINY_DECODER, **family_fields, **overrides})


def tiny_damcha_config(model_type: str, **overrides):
    """The DAMCHA config of the same shape, with a small metric generator."""
    from damcha_hf.families import family_for_model_type

    family = family_for_model_type(model_type)
    return family.config_class(**{**tiny_stock_config(model_type).to_dict(), "metric_hidden_size": 16, **overrides})
