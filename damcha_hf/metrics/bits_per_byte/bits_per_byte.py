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

import evaluate
import numpy as np

from damcha_hf.metrics.language_model_scoring import check_logits_inputs, check_nll_inputs, input_features, sequence_nll

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


def _nll_and_bytes(logits, labels, bytes_per_token, shift, ignore_index):
    nll, scored = sequence_nll("bits_per_byte", logits, labels, shift=shift, ignore_index=ignore_index)
    return nll, len(scored) if bytes_per_token is None else int(np.asarray(bytes_per_token)[scored].sum())


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BitsPerByte(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=input_features("bits_per_byte", self.config_name),
        )

    def _compute(self, predictions, references, bytes_per_token=None, shift=True, ignore_index=-100):
        if self.config_name == "nll":
            check_nll_inputs("bits_per_byte", predictions, references)
            total_nll, num_bytes = float(np.sum(predictions)), int(np.sum(references))
        else:
            check_logits_inputs("bits_per_byte", predictions, references)
            pairs = [
                _nll_and_bytes(p, r, bytes_per_token, shift, ignore_index) for p, r in zip(predictions, references)
            ]
            total_nll, num_bytes = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        if num_bytes <= 0:
            raise ValueError("bits_per_byte: no bytes to score (every label is ignored, or the byte counts are 0).")
        return {"bits_per_byte": total_nll / math.log(2) / num_bytes, "num_bytes": num_bytes}
