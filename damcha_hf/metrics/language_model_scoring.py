"""What the perplexity and bits-per-byte metric modules share: their input checks, their features, and the summed
negative log-likelihood of a sequence's logits. Those modules are loaded by path (`evaluate.load`, which copies the
one file into its cache), so they import this module from the installed package."""

import numpy as np


def check_nll_inputs(name, predictions, references):
    """Summed NLLs must be finite and >= 0, counts integers >= 0, one count per NLL, and at least one of them."""
    nll, counts = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
    if nll.size == 0:
        raise ValueError(f"{name}: no inputs; pass at least one summed NLL and its count.")
    if nll.shape != counts.shape:
        raise ValueError(f"{name}: {nll.size} NLL values but {counts.size} counts; pass one count per NLL value.")
    if not np.all(np.isfinite(nll)) or np.any(nll < 0):
        bad = nll[~np.isfinite(nll) | (nll < 0)][0]
        raise ValueError(
            f"{name}: predictions must be finite, non-negative summed NLLs in nats, got {float(bad)}; a NaN or infinite "
            "loss usually means the model diverged (lower the learning rate)."
        )
    if not np.all(np.isfinite(counts)) or np.any(counts < 0) or np.any(counts != np.round(counts)):
        raise ValueError(f"{name}: references must be non-negative whole counts, got {references!r}.")


def check_logits_inputs(name, predictions, references):
    if len(predictions) == 0:
        raise ValueError(f"{name}: no inputs; pass at least one sequence of logits and its labels.")
    for index, logits in enumerate(predictions):
        if not np.all(np.isfinite(np.asarray(logits, dtype=np.float64))):
            raise ValueError(f"{name}: the logits of sequence {index} hold NaN or infinite values.")


def input_features(name, config_name):
    """The `datasets.Features` of the `"nll"` config (summed NLL, count) or the `"logits"` one (the default)."""
    import datasets

    if config_name == "nll":
        features = {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
    elif config_name in ("logits", "default"):
        features = {
            "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
            "references": datasets.Sequence(datasets.Value("int64")),
        }
    else:
        raise ValueError(f"{name}: unknown config_name {config_name!r}; use 'logits' or 'nll'.")
    return datasets.Features(features)


def sequence_nll(name, logits, labels, *, shift=True, ignore_index=-100):
    """(summed NLL in nats, the labels scored) of one sequence's logits against its labels."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if shift:
        logits, labels = logits[:-1], labels[1:]
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"{name}: logits cover {logits.shape[0]} positions but labels {labels.shape[0]}.")
    keep = labels != ignore_index
    logits, labels = logits[keep], labels[keep]
    if len(labels) == 0:
        return 0.0, labels
    peak = logits.max(axis=-1, keepdims=True)
    log_normaliser = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1))
    return float(np.sum(log_normaliser - logits[np.arange(len(labels)), labels])), labels
