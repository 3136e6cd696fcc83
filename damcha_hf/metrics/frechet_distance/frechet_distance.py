"""Fréchet distance between two sets of feature vectors (an `evaluate` module shipped with damcha-hf).

Fits a Gaussian to each set (mean and covariance) and returns the squared 2-Wasserstein ("Fréchet") distance between
the two Gaussians, the formula of FID (Heusel et al. 2017):

    d^2 = |m_a - m_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^(1/2) S_b S_a^(1/2))^(1/2))

What the distance means depends on the feature network: with Inception-v3 pool features it is FID; with the features
of a classifier trained on the data at hand (what `damcha_hf.diffusion.frechet_classifier_distance` passes) it is a
Fréchet classifier distance, whose values are not comparable with FID's. Loaded by path:
`damcha_hf.metrics.load_metric("frechet_distance")`.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Fréchet distance between Gaussians fitted to two sets of feature vectors (FID's formula)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of feature vectors): features of the generated samples, one vector per sample.
    references (`list` of feature vectors): features of the real (held-out) samples, as many as `predictions`.
Returns:
    frechet_distance (`float`): >= 0; 0 for identical means and covariances.
Example:
    >>> fd = damcha_hf.metrics.load_metric("frechet_distance")
    >>> fd.compute(predictions=[[0.0, 1.0], [1.0, 0.0], [2.0, 2.0]], references=[[0.0, 1.0], [1.0, 0.0], [2.0, 2.0]])
    {'frechet_distance': 0.0}
"""


def gaussian_statistics(features):
    """(mean, covariance with the n - 1 denominator) of `(n, dimension)` features, in float64."""
    features = np.asarray(features, dtype=np.float64)
    return features.mean(axis=0), np.atleast_2d(np.cov(features, rowvar=False))


def _psd_square_root(matrix):
    # A covariance is symmetric positive semi-definite: its eigendecomposition gives a real square root, where a
    # general matrix square root (scipy's sqrtm) can return complex noise for nearly singular covariances.
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0, None))) @ eigenvectors.T


def frechet_distance(mean_a, covariance_a, mean_b, covariance_b) -> float:
    """The Fréchet distance between N(mean_a, covariance_a) and N(mean_b, covariance_b).

    tr((S_a^(1/2) S_b S_a^(1/2))^(1/2)) is the sum of the square roots of the eigenvalues of the symmetric PSD matrix
    S_a^(1/2) S_b S_a^(1/2) (the same as those of S_a S_b, whose square root FID implementations take).
    """
    mean_a, mean_b = np.asarray(mean_a, np.float64), np.asarray(mean_b, np.float64)
    covariance_a, covariance_b = np.asarray(covariance_a, np.float64), np.asarray(covariance_b, np.float64)
    root_a = _psd_square_root(covariance_a)
    product = root_a @ covariance_b @ root_a
    eigenvalues = np.linalg.eigvalsh((product + product.T) / 2)
    cross_term = float(np.sum(np.sqrt(np.clip(eigenvalues, 0, None))))
    distance = float(np.sum((mean_a - mean_b) ** 2) + np.trace(covariance_a) + np.trace(covariance_b) - 2 * cross_term)
    return max(distance, 0.0)  # rounding can leave a tiny negative value for identical Gaussians


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class FrechetDistance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float64")),
                    "references": datasets.Sequence(datasets.Value("float64")),
                }
            ),
        )

    def _compute(self, predictions, references):
        generated, real = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        if generated.ndim != 2 or real.ndim != 2 or generated.shape[1] != real.shape[1]:
            raise ValueError(
                "frechet_distance: predictions and references must be feature vectors of one common length, got "
                f"shapes {generated.shape} and {real.shape}."
            )
        if len(generated) < 2:
            raise ValueError("frechet_distance: a covariance needs at least 2 feature vectors per set.")
        if not (np.all(np.isfinite(generated)) and np.all(np.isfinite(real))):
            raise ValueError("frechet_distance: the features hold NaN or infinite values.")
        return {"frechet_distance": frechet_distance(*gaussian_statistics(generated), *gaussian_statistics(real))}
