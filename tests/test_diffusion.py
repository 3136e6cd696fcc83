"""damcha_hf.diffusion and the `frechet_distance` metric module against oracles: the Fréchet distance of Gaussians in
closed form and by scipy's general matrix square root, DDPM's noising formula from its betas, DDIM sampling with the
exact noise predictor of a one-image data set (it must return that image), and PNG grids read back pixel by pixel."""

import importlib.util
import io
import math
import sys

import numpy as np
import pytest
import scipy.linalg
import torch
import transformers
from conftest import TINY_VIT
from PIL import Image

import damcha_hf
from damcha_hf import diffusion
from damcha_hf.metrics import load_metric, metric_path


def frechet_module():
    path = f"{metric_path('frechet_distance')}/frechet_distance.py"
    spec = importlib.util.spec_from_file_location("frechet_distance_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the Fréchet distance ---------------------------------------------------------------------------------------------


def test_frechet_distance_of_gaussians_matches_the_closed_forms():
    distance = frechet_module().frechet_distance
    # One dimension: (m_a - m_b)^2 + (s_a - s_b)^2.
    assert distance([1.0], [[4.0]], [-2.0], [[9.0]]) == pytest.approx(9 + 1)
    # Diagonal covariances commute: |m_a - m_b|^2 + sum (sqrt(a_i) - sqrt(b_i))^2.
    a, b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    mean_a, mean_b = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    expected = np.sum((mean_a - mean_b) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert distance(mean_a, np.diag(a), mean_b, np.diag(b)) == pytest.approx(expected)
    # Covariances that do not commute: the textbook form with scipy's general matrix square root of S_a S_b.
    rng = np.random.default_rng(0)
    left, right = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    cov_a, cov_b = left @ left.T + 0.1 * np.eye(5), right @ right.T + 0.1 * np.eye(5)
    expected = 5 * (mean_a[0] - 3) ** 2 + np.trace(cov_a + cov_b) - 2 * np.trace(scipy.linalg.sqrtm(cov_a @ cov_b)).real
    assert distance(np.full(5, mean_a[0]), cov_a, np.full(5, 3.0), cov_b) == pytest.approx(expected, rel=1e-8)
    assert distance(mean_a, np.diag(a), mean_a, np.diag(a)) == 0.0


def test_the_metric_module_estimates_the_distance_of_the_sampling_gaussians():
    rng = np.random.default_rng(1)
    cov_b = np.array([[2.0, 0.6, 0.0], [0.6, 1.0, 0.3], [0.0, 0.3, 0.5]])
    a = rng.normal(size=(20000, 3))
    b = rng.multivariate_normal([0.5, 0.0, -0.5], cov_b, size=20000)
    expected = frechet_module().frechet_distance(np.zeros(3), np.eye(3), [0.5, 0.0, -0.5], cov_b)
    metric = load_metric("frechet_distance")
    assert metric.compute(predictions=a, references=b)["frechet_distance"] == pytest.approx(expected, abs=0.03)
    assert metric.compute(predictions=a[:50], references=a[:50])["frechet_distance"] == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="feature vectors of one common length"):
        metric.compute(predictions=a[:4, :2], references=b[:4])


def test_fcd_reads_the_feature_the_classifier_reads_and_is_zero_for_the_same_images():
    torch.manual_seed(0)
    classifier = damcha_hf.DamchaViTForImageClassification(damcha_hf.DamchaViTConfig(**TINY_VIT)).eval()
    images = torch.rand(24, 1, 28, 28) * 2 - 1
    features = diffusion.classifier_features(classifier, images, batch_size=10)
    with torch.no_grad():  # the classifier's logits are its linear layer applied to exactly this feature
        torch.testing.assert_close(classifier.classifier(features.float()), classifier(images).logits)
    assert diffusion.frechet_classifier_distance(classifier, images, images) == pytest.approx(0, abs=1e-9)
    other = torch.rand(24, 1, 28, 28) * 2 - 1
    module = frechet_module()
    expected = module.frechet_distance(
        *module.gaussian_statistics(diffusion.classifier_features(classifier, other).numpy()),
        *module.gaussian_statistics(diffusion.classifier_features(classifier, images).numpy()),
    )
    assert diffusion.frechet_classifier_distance(classifier, other, images) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="24 generated but 23 held-out images"):
        diffusion.frechet_classifier_distance(classifier, images, images[:23])


# --- the schedule, sampling and the per-range error -------------------------------------------------------------------


def test_noising_follows_ddpm_closed_form_from_the_linear_betas():
    scheduler = diffusion.training_scheduler()
    alpha_bar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    images = torch.rand(6, 1, 4, 4) * 2 - 1
    noisy, noise, timesteps = diffusion.noised_batch(scheduler, images, torch.Generator().manual_seed(0))
    scale = torch.tensor(alpha_bar[timesteps.numpy()], dtype=torch.float32)[:, None, None, None]
    torch.testing.assert_close(noisy, scale.sqrt() * images + (1 - scale).sqrt() * noise, rtol=1e-5, atol=1e-5)
    assert timesteps.min() >= 0 and timesteps.max() < 1000 and len(set(timesteps.tolist())) > 1


class ExactDenoiserOfOneImage(torch.nn.Module):
    """The exact noise predictor when the data is the single image `target`: eps = (x_t - sqrt(abar_t) x_0) /
    sqrt(1 - abar_t)."""

    def __init__(self, target: torch.Tensor, scheduler):
        super().__init__()
        self.register_buffer("target", target)
        self.alpha_bar = scheduler.alphas_cumprod
        channels, size, _ = target.shape
        self.config = transformers.PretrainedConfig(image_size=size, num_channels=channels)

    def forward(self, images, timestep):
        timestep = torch.as_tensor(timestep).expand(len(images))
        alpha_bar = self.alpha_bar[timestep][:, None, None, None]
        noise = (images - alpha_bar.sqrt() * self.target) / (1 - alpha_bar).sqrt()
        return transformers.utils.ModelOutput(sample=noise)


def test_ddim_sampling_with_the_exact_noise_predictor_returns_the_one_training_image():
    scheduler = diffusion.training_scheduler()
    target = torch.rand(1, 6, 6) * 1.6 - 0.8
    model = ExactDenoiserOfOneImage(target, scheduler)
    samples = diffusion.sample_images(model, scheduler, 5, num_inference_steps=4, batch_size=2,
                                      generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert samples.shape == (5, 1, 6, 6)
    torch.testing.assert_close(samples, target.expand(5, 1, 6, 6), rtol=0, atol=1e-4)


def test_denoising_mse_is_zero_for_the_exact_predictor_and_the_noise_power_for_a_zero_one():
    scheduler = diffusion.training_scheduler()
    target = torch.rand(1, 8, 8) * 2 - 1
    exact = ExactDenoiserOfOneImage(target, scheduler)
    images = target.expand(40, 1, 8, 8).contiguous()
    results = diffusion.denoising_mse_by_timestep_range(exact, scheduler, images, num_ranges=4, batch_size=16,
                                                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert list(results) == ["mse_t000-249", "mse_t250-499", "mse_t500-749", "mse_t750-999", "mse"]
    assert max(results.values()) < 1e-6
    zero = damcha_hf.DamchaViTDenoiserModel(damcha_hf.DamchaViTDenoiserConfig(**{**TINY_VIT, "image_size": 8}))
    first, second = (
        diffusion.denoising_mse_by_timestep_range(zero, scheduler, images, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    )
    assert first == second  # the same generator, the same noise and timesteps: models compare pairwise
    # A fresh denoiser predicts zero: its error is the mean square of 40 * 64 standard normal draws per range.
    assert all(abs(value - 1) < 5 * math.sqrt(2 / (40 * 64)) for value in first.values())


def test_timestep_ranges_cover_every_timestep_once():
    assert diffusion.timestep_ranges(1000, 3) == [(0, 333), (333, 667), (667, 1000)]


def test_image_grid_places_each_image_and_maps_minus_one_to_black_and_one_to_white():
    images = torch.rand(5, 1, 3, 4) * 2 - 1
    images[0] = -1
    images[1] = 1
    picture = np.asarray(Image.open(io.BytesIO(diffusion.image_grid_png(images, columns=2, padding=1))))
    assert picture.shape == (3 * 4 + 1, 2 * 5 + 1)
    for index, image in enumerate(images):
        row, column = divmod(index, 2)
        tile = picture[1 + row * 4 : 1 + row * 4 + 3, 1 + column * 5 : 1 + column * 5 + 4]
        np.testing.assert_array_equal(tile, np.round((image[0].numpy() + 1) * 127.5).astype(np.uint8))
    assert picture[0].max() == 0 and (picture[1:4, 1:5] == 0).all() and (picture[1:4, 6:10] == 255).all()
    rgb = np.asarray(Image.open(io.BytesIO(diffusion.image_grid_png(torch.zeros(2, 3, 2, 2)))))
    assert rgb.shape == (2 + 2 * 2, 2 * 4 + 2, 3)


def test_without_diffusers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(ImportError, match=r"pip install damcha-hf\[diffusion\]"):
        diffusion.training_scheduler()
