"""Corpus BLEU and chrF of generated text, computed by `sacrebleu` (an `evaluate` module shipped with damcha-hf).

The Hub's `evaluate-metric/sacrebleu` and `chrf` cannot be fetched offline; this module is loaded by path instead:
`damcha_hf.metrics.load_metric("sacrebleu_scores")` or `evaluate.load(<path to this folder>)`.
"""

import datasets
import evaluate

_DESCRIPTION = (
    "Corpus-level BLEU (sacrebleu's default 13a tokenisation, exponential smoothing) and chrF (character 6-grams, "
    "beta 2), both on a 0-100 scale, with one reference per prediction."
)

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): generated texts.
    references (`list` of `str`): one reference text per prediction.
Returns:
    bleu (`float`): corpus BLEU, 0-100.
    chrf (`float`): corpus chrF, 0-100.
Example:
    >>> scores = damcha_hf.metrics.load_metric("sacrebleu_scores")
    >>> scores.compute(predictions=["the cat sat on the mat"], references=["the cat sat on the mat"])
    {'bleu': 100.00000000000004, 'chrf': 100.0}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuScores(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Post, 'A Call for Clarity in Reporting BLEU Scores', WMT 2018.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        import sacrebleu

        if not predictions:
            raise ValueError("sacrebleu_scores: no predictions; pass at least one prediction and its reference.")
        return {
            "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
            "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
        }
