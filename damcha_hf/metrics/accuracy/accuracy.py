"""Accuracy: the share of predictions equal to their reference label (an `evaluate` module shipped with damcha-hf).

The Hub's `evaluate-metric/accuracy` cannot be fetched offline; this module is loaded by path instead:
`damcha_hf.metrics.load_metric("accuracy")` or `evaluate.load(<path to this folder>)`.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy = (number of predictions equal to the reference) / (number of predictions)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted class ids (for example `logits.argmax(-1)`).
    references (`list` of `int`): true class ids.
    normalize (`bool`, defaults to `True`): return the share of correct predictions; `False` returns their count.
    sample_weight (`list` of `float`, *optional*): a weight per example.
Returns:
    accuracy (`float`): between 0 and 1 (or the count of correct predictions when `normalize=False`).
Example:
    >>> accuracy = damcha_hf.metrics.load_metric("accuracy")
    >>> accuracy.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(
                f"accuracy: {predictions.shape[0]} predictions but {references.shape[0]} references; pass one "
                "prediction per reference."
            )
        if predictions.size == 0:
            raise ValueError("accuracy: no predictions; pass at least one prediction and its reference.")
        weights = np.ones(len(predictions)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if weights.shape != predictions.shape or not np.all(np.isfinite(weights)) or np.any(weights < 0):
            raise ValueError("accuracy: sample_weight must hold one finite, non-negative weight per prediction.")
        if normalize and not np.sum(weights) > 0:
            raise ValueError("accuracy: the sample weights sum to 0, so no accuracy can be computed.")
        correct = float(np.sum(weights * (predictions == references)))
        return {"accuracy": correct / float(np.sum(weights)) if normalize else correct}
