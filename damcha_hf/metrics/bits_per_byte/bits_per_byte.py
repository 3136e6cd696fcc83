"""Bits per byte of a language model, the enwik8 / text8 measure: total negative log-likelihood in bits divided by
the number of UTF-8 bytes of the scored text (an `evaluate` module shipped with damcha-hf, loaded by path:
`damcha_hf.metrics.load_metric("bits_per_byte")`). Comparable across tokenizers, unlike perplexity per token.

Two input forms, chosen with `config_name`:

* `"logits"` (default): `predictions` = logits per sequence (`[seq, vocab]`), `references` = label ids (`[seq]`,
  `-100` ignored); `bytes_per_token` (a list indexed by token id, e.g. `damcha_hf.data.token_byte_lengths`) gives
  the bytes each label stands for; without it every token is one byte (a byte-level tokenizer).
* `"nll"`: `predictions` = a summed negative log-likelihood in nats, `references` = the number of bytes it covers.
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Bits per byte = total negative log-likelihood (nats) / ln 2 / number of UTF-8 bytes scored."

_KWARGS_DESCRIPTION = """
Args:
    predictions: logits per sequence (`config_name="logits"`) or summed NLL in nats (`config_name="nll"`).
    references: label ids per sequence (`"logits"`; -100 is ignored) or byte counts (`"nll"`).
    bytes_per_token (`list` of `int`, *optional*, `"logits"` only): UTF-8 bytes per token id (default: 1 each).
    shift (`bool`, defaults to `True`, `"logits"` only): logits at position t predict the label at t + 1.
    ignore_index (`int`, defaults to -100, `"logits"` only): label value that is not scored.
Returns:
    bits_per_byte (`float`), num_bytes (`int`).
"""


# `evaluate.load(path)` copies this one file into its cache, so each metric module checks its inputs itself.
def _check_nll_inputs(name, predictions, references):
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


def _check_logits_inputs(name, predictions, references):
    if len(predictions) == 0:
        raise ValueError(f"{name}: no inputs; pass at least one sequence of logits and its labels.")
    for index, logits in enumerate(predictions):
        if not np.all(np.isfinite(np.asarray(logits, dtype=np.float64))):
            raise ValueError(f"{name}: the logits of sequence {index} hold NaN or infinite values.")


# The summed-NLL code is repeated from the perplexity module rather than imported from it (see above).
def _nll_and_bytes(logits, labels, bytes_per_token, shift, ignore_index):
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if shift:
        logits, labels = logits[:-1], labels[1:]
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"bits_per_byte: logits cover {logits.shape[0]} positions but labels {labels.shape[0]}.")
    keep = labels != ignore_index
    logits, labels = logits[keep], labels[keep]
    if len(labels) == 0:
        return 0.0, 0
    peak = logits.max(axis=-1, keepdims=True)
    log_normaliser = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1))
    nll = float(np.sum(log_normaliser - logits[np.arange(len(labels)), labels]))
    num_bytes = len(labels) if bytes_per_token is None else int(np.asarray(bytes_per_token)[labels].sum())
    return nll, num_bytes


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BitsPerByte(evaluate.Metric):
    def _info(self):
        if self.config_name == "nll":
            features = {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
        elif self.config_name in ("logits", "default"):
            features = {
                "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                "references": datasets.Sequence(datasets.Value("int64")),
            }
        else:
            raise ValueError(f"bits_per_byte: unknown config_name {self.config_name!r}; use 'logits' or 'nll'.")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(features),
        )

    def _compute(self, predictions, references, bytes_per_token=None, shift=True, ignore_index=-100):
        if self.config_name == "nll":
            _check_nll_inputs("bits_per_byte", predictions, references)
            total_nll, num_bytes = float(np.sum(predictions)), int(np.sum(references))
        else:
            _check_logits_inputs("bits_per_byte", predictions, references)
            pairs = [
                _nll_and_bytes(p, r, bytes_per_token, shift, ignore_index) for p, r in zip(predictions, references)
            ]
            total_nll, num_bytes = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        if num_bytes <= 0:
            raise ValueError("bits_per_byte: no bytes to score (every label is ignored, or the byte counts are 0).")
        return {"bits_per_byte": total_nll / math.log(2) / num_bytes, "num_bytes": num_bytes}
