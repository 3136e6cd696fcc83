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

import evaluate
import numpy as np

from damcha_hf.metrics.language_model_scoring import check_logits_inputs, check_nll_inputs, input_features, sequence_nll

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


def token_nll(logits, labels, *, shift=True, ignore_index=-100):
    """(summed NLL in nats, number of scored tokens) of one sequence's logits against its labels."""
    nll, scored = sequence_nll("perplexity", logits, labels, shift=shift, ignore_index=ignore_index)
    return nll, len(scored)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=input_features("perplexity", self.config_name),
        )

    def _compute(self, predictions, references, shift=True, ignore_index=-100):
        if self.config_name == "nll":
            check_nll_inputs("perplexity", predictions, references)
            total_nll, num_tokens = float(np.sum(predictions)), int(np.sum(references))
        else:
            check_logits_inputs("perplexity", predictions, references)
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
