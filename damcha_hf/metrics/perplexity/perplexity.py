"""Perplexity of a causal language model, `exp(mean negative log-likelihood per token)` (an `evaluate` module
shipped with damcha-hf, loaded by path: `damcha_hf.metrics.load_metric("perplexity")`).

Unlike the Hub's `perplexity`, which runs a model itself, this module scores outputs you already have. Two input
forms, chosen with `config_name`:

* `"logits"` (default): `predictions` = logits per sequence (`[seq, vocab]`), `references` = label ids per sequence
  (`[seq]`, `-100` ignored). With `shift=True` (default, the transformers convention where labels are the input
  ids) position `t` predicts label `t + 1`.
* `"nll"`: `predictions` = a summed negative log-likelihood in nats, `references` = the number of tokens it covers;
  e.g. one row per evaluation batch, or `(eval_loss * num_tokens, num_tokens)` from a `Trainer`.
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Perplexity = exp(total negative log-likelihood in nats / number of predicted tokens)."

_KWARGS_DESCRIPTION = """
Args:
    predictions: logits per sequence (`config_name="logits"`) or summed NLL in nats (`config_name="nll"`).
    references: label ids per sequence (`"logits"`; -100 is ignored) or token counts (`"nll"`).
    shift (`bool`, defaults to `True`, `"logits"` only): logits at position t predict the label at t + 1.
    ignore_index (`int`, defaults to -100, `"logits"` only): label value that is not scored.
Returns:
    perplexity (`float`), mean_nll (`float`, nats per token), num_tokens (`int`).
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


def token_nll(logits, labels, *, shift=True, ignore_index=-100):
    """(summed NLL in nats, number of scored tokens) of one sequence's logits against its labels."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if shift:
        logits, labels = logits[:-1], labels[1:]
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"perplexity: logits cover {logits.shape[0]} positions but labels {labels.shape[0]}.")
    keep = labels != ignore_index
    logits, labels = logits[keep], labels[keep]
    if len(labels) == 0:
        return 0.0, 0
    peak = logits.max(axis=-1, keepdims=True)
    log_normaliser = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1))
    return float(np.sum(log_normaliser - logits[np.arange(len(labels)), labels])), len(labels)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        if self.config_name == "nll":
            features = {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
        elif self.config_name in ("logits", "default"):
            features = {
                "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                "references": datasets.Sequence(datasets.Value("int64")),
            }
        else:
            raise ValueError(f"perplexity: unknown config_name {self.config_name!r}; use 'logits' or 'nll'.")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(features),
        )

    def _compute(self, predictions, references, shift=True, ignore_index=-100):
        if self.config_name == "nll":
            _check_nll_inputs("perplexity", predictions, references)
            total_nll, num_tokens = float(np.sum(predictions)), int(np.sum(references))
        else:
            _check_logits_inputs("perplexity", predictions, references)
            pairs = [token_nll(p, r, shift=shift, ignore_index=ignore_index) for p, r in zip(predictions, references)]
            total_nll, num_tokens = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        if num_tokens <= 0:
            raise ValueError("perplexity: no tokens to score (every label is ignored, or the token counts are 0).")
        mean_nll = total_nll / num_tokens
        # exp overflows a float above about 709 nats per token: the perplexity is then reported as infinite.
        return {
            "perplexity": math.exp(mean_nll) if mean_nll < 709.0 else math.inf,
            "mean_nll": mean_nll,
            "num_tokens": num_tokens,
        }
