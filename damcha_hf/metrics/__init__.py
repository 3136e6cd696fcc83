"""`evaluate` metric modules shipped inside damcha-hf, since the Hub copies cannot be fetched offline.

    damcha_hf.metrics.load_metric("accuracy")                      # ViT classification
    damcha_hf.metrics.load_metric("perplexity", "nll")             # GPT-2: exp(mean NLL)
    damcha_hf.metrics.load_metric("bits_per_byte", "nll")          # GPT-2: NLL in bits per UTF-8 byte

Each is an `evaluate.Metric` subclass in `damcha_hf/metrics/<name>/<name>.py`, so `evaluate.load(metric_path(name))`
loads it too. The `"logits"` config (default for perplexity and bits_per_byte) takes logits and labels; `"nll"` takes
summed negative log-likelihoods and the token / byte counts they cover.
"""

import os

METRIC_NAMES = ("accuracy", "perplexity", "bits_per_byte")
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


__all__ = ["METRIC_NAMES", "metric_path", "load_metric"]
