"""Tiny random stock checkpoints of every decoder family, with a byte-level tokenizer saved beside the weights: what a
user's pretrained folder looks like, small enough for a 2-step run.

The tokenizer is `damcha_hf.data.byte_level_tokenizer` (one token per byte, `<|endoftext|>` id 256, no padding token:
GPT-2's tokenizer has none either), so the model's vocabulary is 257 tokens (a few more, as pretrained models pad it).
"""

from pathlib import Path

import torch
import transformers
from conftest import tiny_gpt2_config, tiny_llama_config
from tiny_decoders import tiny_stock_config

from damcha_hf.data import byte_level_tokenizer
from damcha_hf.families import family_for_model_type

DECODER_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2")
VOCAB = 260
END_OF_TEXT = 256
SPECIAL_IDS = {"bos_token_id": END_OF_TEXT, "eos_token_id": END_OF_TEXT, "pad_token_id": END_OF_TEXT}


def stock_decoder_config(model_type: str):
    if model_type == "gpt2":
        return tiny_gpt2_config(vocab_size=VOCAB, **SPECIAL_IDS)
    if model_type == "llama":
        return tiny_llama_config(vocab_size=VOCAB, **SPECIAL_IDS)
    return tiny_stock_config(model_type, vocab_size=VOCAB, **SPECIAL_IDS)


def stock_decoder(model_type: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny stock causal LM of `model_type`, random weights (seeded), eval mode."""
    torch.manual_seed(seed)
    stock_class = family_for_model_type(model_type).task_head.stock_class
    model = stock_class(stock_decoder_config(model_type))
    return model.eval()


def write_stock_decoder(folder: Path, model_type: str, *, seed: int = 0, tokenizer=None) -> Path:
    """Save a tiny stock `model_type` causal LM and its tokenizer (the byte-level one unless given) into `folder`."""
    stock_decoder(model_type, seed).save_pretrained(folder)
    (tokenizer or byte_level_tokenizer()).save_pretrained(folder)
    return folder
