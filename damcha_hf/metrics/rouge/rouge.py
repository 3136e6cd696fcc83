"""ROUGE-1, ROUGE-2 and ROUGE-L F1 of generated text, computed by `rouge-score` (an `evaluate` module shipped with
damcha-hf).

The Hub's `evaluate-metric/rouge` cannot be fetched offline; this module is loaded by path instead:
`damcha_hf.metrics.load_metric("rouge")` or `evaluate.load(<path to this folder>)`.
"""

import datasets
import evaluate

_DESCRIPTION = (
    "The mean over predictions of the ROUGE-1, ROUGE-2 and ROUGE-L F1 scores (0-1) against one reference each, "
    "with rouge-score's default tokenisation (lower case, alphanumeric tokens) and its Porter stemmer."
)

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): generated texts.
    references (`list` of `str`): one reference text per prediction.
Returns:
    rouge1, rouge2, rougeL (`float`): mean F1, 0-1.
Example:
    >>> rouge = damcha_hf.metrics.load_metric("rouge")
    >>> rouge.compute(predictions=["the cat sat"], references=["the cat sat"])
    {'rouge1': 1.0, 'rouge2': 1.0, 'rougeL': 1.0}
"""

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, 'ROUGE: A Package for Automatic Evaluation of Summaries', ACL workshop 2004.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        from rouge_score import rouge_scorer

        if not predictions:
            raise ValueError("rouge: no predictions; pass at least one prediction and its reference.")
        scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
        totals = dict.fromkeys(ROUGE_TYPES, 0.0)
        for prediction, reference in zip(predictions, references, strict=True):
            scores = scorer.score(reference, prediction)
            for name in ROUGE_TYPES:
                totals[name] += scores[name].fmeasure
        return {name: total / len(predictions) for name, total in totals.items()}
