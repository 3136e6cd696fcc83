"""`evaluate` metric modules shipped inside damcha-hf, since the Hub copies cannot be fetched offline.

    damcha_hf.metrics.load_metric("accuracy")                      # ViT classification
    damcha_hf.metrics.load_metric("perplexity", "nll")             # GPT-2: exp(mean NLL)
    damcha_hf.metrics.load_metric("bits_per_byte", "nll")          # GPT-2: NLL in bits per UTF-8 byte
    damcha_hf.metrics.load_metric("sacrebleu_scores")              # BART: corpus BLEU and chrF (sacrebleu)
    damcha_hf.metrics.load_metric("rouge")                         # BART: ROUGE-1/2/L F1 (rouge-score)
    damcha_hf.metrics.load_metric("frechet_distance")              # diffusion: two sets of feature vectors

Each is an `evaluate.Metric` subclass in `damcha_hf/metrics/<name>/<name>.py`, so `evaluate.load(metric_path(name))`
loads it too. The `"logits"` config (default for perplexity and bits_per_byte) takes logits and labels; `"nll"` takes
summed negative log-likelihoods and the token / byte counts they cover.
"""

import os

METRIC_NAMES = ("accuracy", "perplexity", "bits_per_byte", "sacrebleu_scores", "rouge", "frechet_distance")
_HERE = os.path.dirname(os.path.abspath(__file__))


def metric_path(name: str) -> str:
    """The folder of a shipped metric module, for `evaluate.load(path)`."""
    if name not in METRIC_NAMES:
        raise ValueError(f"Unknown damcha-hf metric {name!r}; choose one of {', '.join(map(repr, METRIC_NAMES))}.")
    return os.path.join(_HERE, name)


def load_metric(name: str, config_name: str | None = None, **kwargs):
    """`evaluate.load` of a shipped metric module by path (works offline)."""
    import evaluate

    return evaluate.load(metric_path(name), config_name, **kwargs)


def causal_lm_token_nll(logits, labels, ignore_index: int = -100):
    """Per-position NLL (nats) of next-token prediction: `(batch, seq - 1)`, 0 where the label is ignored.

    Use as a `Trainer`'s `preprocess_logits_for_metrics`, so evaluation keeps one float per token instead of the
    full `(batch, seq, vocab)` logits.
    """
    import torch

    if isinstance(logits, tuple):
        logits = logits[0]
    shifted_labels = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), shifted_labels.flatten(), ignore_index=ignore_index, reduction="none"
    )
    return nll.view_as(shifted_labels)


def causal_lm_compute_metrics(tokenizer=None, ignore_index: int = -100):
    """A `Trainer` `compute_metrics` for outputs of `causal_lm_token_nll`: perplexity and bits per byte, through the
    shipped evaluate modules. `tokenizer` gives each token's byte length (`None`: one byte per token)."""
    import numpy as np

    from ..data import token_byte_lengths

    byte_lengths = None if tokenizer is None else token_byte_lengths(tokenizer)
    perplexity, bits_per_byte = load_metric("perplexity", "nll"), load_metric("bits_per_byte", "nll")

    def compute_metrics(eval_prediction):
        nll, labels = eval_prediction.predictions, eval_prediction.label_ids
        nll, shifted_labels = np.asarray(nll, dtype=np.float64), np.asarray(labels)[:, 1:]
        scored = shifted_labels != ignore_index
        total_nll, num_tokens = float(nll[scored].sum()), int(scored.sum())
        num_bytes = num_tokens if byte_lengths is None else int(byte_lengths[shifted_labels[scored]].sum())
        results = perplexity.compute(predictions=[total_nll], references=[num_tokens])
        results.update(bits_per_byte.compute(predictions=[total_nll], references=[num_bytes]))
        return {"perplexity": results["perplexity"], "bits_per_byte": results["bits_per_byte"]}

    return compute_metrics


def accuracy_compute_metrics():
    """A `Trainer` `compute_metrics` for classification logits: top-1 accuracy through the shipped module."""
    import numpy as np

    accuracy = load_metric("accuracy")

    def compute_metrics(eval_prediction):
        logits = eval_prediction.predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        return accuracy.compute(predictions=np.argmax(logits, axis=-1), references=eval_prediction.label_ids)

    return compute_metrics


__all__ = [
    "METRIC_NAMES",
    "accuracy_compute_metrics",
    "causal_lm_compute_metrics",
    "causal_lm_token_nll",
    "load_metric",
    "metric_path",
]
