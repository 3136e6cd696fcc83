"""Diffusion with the DAMCHA ViT denoiser: diffusers' schedulers, sampling, sample grids and the evaluation metrics.

    from damcha_hf.diffusion import training_scheduler, noised_batch, sample_images, save_image_grid

    scheduler = training_scheduler()                          # DDPM: 1000 steps, linear betas, noise prediction
    noisy, noise, timesteps = noised_batch(scheduler, images)  # images scaled to [-1, 1]
    loss = model(noisy, timesteps, labels=noise).loss
    samples = sample_images(model, scheduler, 16, num_inference_steps=50)   # DDIM, deterministic (eta = 0)
    save_image_grid(samples, "samples.png")

The noise schedule comes from `diffusers` (`DDPMScheduler` for training, `DDIMScheduler` for fast sampling), an
optional dependency: `pip install damcha-hf[diffusion]`. Evaluation:

* `denoising_mse_by_timestep_range`: the noise-prediction error on held-out images, per range of timesteps (the error
  of the training objective, split where the task is easy (t near 0) and hard).
* `frechet_classifier_distance` (FCD): the Fréchet distance between Gaussians fitted to the features of generated and
  held-out images, in the feature space of an image classifier trained on the same data (the shipped evaluate module
  `frechet_distance` computes it). It is FID's formula with another feature network, so its values are not FID values
  and are not comparable with published FIDs (see docs/diffusion.md).
"""

from __future__ import annotations

import io
import itertools
import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIFFUSERS_MISSING = (
    "this needs diffusers (its DDPM and DDIM noise schedulers), which is not installed; install it with "
    "`pip install damcha-hf[diffusion]` (or `pip install diffusers`)"
)


def require_diffusers():
    """The `diffusers` module, or an `ImportError` saying how to install it."""
    try:
        import diffusers
    except ImportError as error:
        raise ImportError(f"damcha_hf.diffusion: {DIFFUSERS_MISSING}.") from error
    return diffusers


def training_scheduler(num_train_timesteps: int = 1000, beta_schedule: str = "linear"):
    """diffusers' `DDPMScheduler` for training: noise prediction (`prediction_type="epsilon"`), samples clipped to
    [-1, 1]. `beta_schedule`: "linear" (DDPM's, 1e-4 to 0.02) or "squaredcos_cap_v2" (the cosine schedule)."""
    diffusers = require_diffusers()
    return diffusers.DDPMScheduler(
        num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule, prediction_type="epsilon"
    )


def sampling_scheduler(scheduler):
    """A `DDIMScheduler` with the noise schedule of `scheduler` (a DDPM one, or its saved config), stepping on
    "trailing" timesteps, so that even a few steps start from the last, pure-noise timestep."""
    diffusers = require_diffusers()
    config = getattr(scheduler, "config", scheduler)
    return diffusers.DDIMScheduler.from_config(config, timestep_spacing="trailing")


def noised_batch(scheduler, images: torch.Tensor, generator: torch.Generator | None = None):
    """(noisy images, the noise, the timesteps): one timestep per image, uniform over the training timesteps, and
    Gaussian noise added by `scheduler.add_noise` (`x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise`)."""
    import torch

    steps = scheduler.config.num_train_timesteps
    noise = torch.randn(images.shape, generator=generator, dtype=images.dtype).to(images.device)
    timesteps = torch.randint(0, steps, (len(images),), generator=generator).to(images.device)
    return scheduler.add_noise(images, noise, timesteps), noise, timesteps


def _device_of(model) -> torch.device:
    return next(itertools.chain(model.parameters(), model.buffers())).device


def _eval_mode(model):
    """Context: `model` in eval mode, restored afterwards, with no gradient."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def context():
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            model.train(was_training)

    return context()


def sample_images(
    model,
    scheduler,
    num_images: int,
    *,
    num_inference_steps: int = 50,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """`num_images` images in [-1, 1], `(num_images, channels, height, width)`, sampled by DDIM (eta = 0: the start
    noise from `generator` decides each image) in `num_inference_steps` steps on `scheduler`'s noise schedule."""
    import torch

    config = model.config
    height, width = (config.image_size,) * 2 if isinstance(config.image_size, int) else tuple(config.image_size)
    device = _device_of(model)
    sampler = sampling_scheduler(scheduler)
    sampler.set_timesteps(num_inference_steps)
    # The start noise of every image is drawn first, so the images do not depend on the batch size.
    start = torch.randn((num_images, config.num_channels, height, width), generator=generator)
    samples = []
    with _eval_mode(model):
        for images in start.split(batch_size):
            images = images.to(device)
            for timestep in sampler.timesteps:
                predicted_noise = model(images, timestep.to(device)).sample
                images = sampler.step(predicted_noise, timestep, images).prev_sample
            samples.append(images.clamp(-1, 1).cpu())
    return torch.cat(samples)


def timestep_ranges(num_train_timesteps: int, num_ranges: int) -> list[tuple[int, int]]:
    """`num_ranges` consecutive [start, end) ranges of equal width covering the training timesteps."""
    bounds = [round(index * num_train_timesteps / num_ranges) for index in range(num_ranges + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def denoising_mse_by_timestep_range(
    model,
    scheduler,
    images: torch.Tensor,
    *,
    num_ranges: int = 4,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
) -> dict[str, float]:
    """The noise-prediction mean squared error on `images` (in [-1, 1]), per timestep range.

    Each image is noised once per range, at a timestep drawn uniformly from that range (the same noise and timesteps
    for every model given the same `generator`, so models compare pairwise). Returns `{"mse_t000-249": ..., ...,
    "mse": the mean over the ranges}` (with 1000 timesteps and 4 ranges), the ranges being equal in width, so `mse` is
    the training objective's expected value.
    """
    import torch

    steps = scheduler.config.num_train_timesteps
    width = len(str(steps - 1))
    device = _device_of(model)
    results = {}
    with _eval_mode(model):
        for start, end in timestep_ranges(steps, num_ranges):
            squared_error, count = 0.0, 0
            for batch in images.split(batch_size):
                noise = torch.randn(batch.shape, generator=generator)
                timesteps = torch.randint(start, end, (len(batch),), generator=generator)
                noisy = scheduler.add_noise(batch, noise, timesteps)
                predicted = model(noisy.to(device), timesteps.to(device)).sample.float().cpu()
                squared_error += float(((predicted - noise) ** 2).sum())
                count += noise.numel()
            results[f"mse_t{start:0{width}d}-{end - 1:0{width}d}"] = squared_error / count
    results["mse"] = sum(results.values()) / num_ranges
    return results


def classifier_features(classifier, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """`(num_images, hidden_size)` float64: the CLS feature of a ViT image classifier (DAMCHA or stock), the vector
    its linear classifier reads (after the final layer norm). `images` as the classifier was trained on them (the
    recipes' processor scales to [-1, 1], as the denoiser's images are)."""
    import torch

    device = _device_of(classifier)
    features = []
    with _eval_mode(classifier):
        for batch in images.split(batch_size):
            hidden = classifier.base_model(batch.to(device)).last_hidden_state
            features.append(hidden[:, 0].double().cpu())
    return torch.cat(features)


def frechet_classifier_distance(classifier, generated: torch.Tensor, held_out: torch.Tensor) -> float:
    """The Fréchet classifier distance (FCD): the Fréchet distance between Gaussians fitted to the
    `classifier_features` of `generated` and of `held_out` images (the same number of each), computed by the shipped
    evaluate module `frechet_distance`. Lower is closer. Not FID: the features are not Inception-v3's."""
    from .metrics import load_metric

    if len(generated) != len(held_out):
        raise ValueError(
            f"frechet_classifier_distance: {len(generated)} generated but {len(held_out)} held-out images; the "
            "metric compares equal numbers (the bias of the Fréchet distance depends on the sample size)."
        )
    metric = load_metric("frechet_distance")
    result = metric.compute(
        predictions=classifier_features(classifier, generated).numpy(),
        references=classifier_features(classifier, held_out).numpy(),
    )
    return result["frechet_distance"]


def image_grid_png(images: torch.Tensor, columns: int | None = None, padding: int = 2) -> bytes:
    """PNG bytes of `images` (`(n, channels, height, width)` in [-1, 1]; 1 or 3 channels) in a grid, `columns`
    wide (default: the smallest square that holds them), with `padding` black pixels between images."""
    import numpy as np
    import torch
    from PIL import Image

    count, channels, height, width = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    grid = np.zeros((rows * (height + padding) + padding, columns * (width + padding) + padding, channels), np.uint8)
    for index, image in enumerate(pixels):
        row, column = divmod(index, columns)
        top, left = padding + row * (height + padding), padding + column * (width + padding)
        grid[top : top + height, left : left + width] = image.transpose(1, 2, 0)
    picture = Image.fromarray(grid[:, :, 0] if channels == 1 else grid)  # uint8: grey ("L") or "RGB"
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def save_image_grid(images: torch.Tensor, path: str | os.PathLike, columns: int | None = None) -> str:
    """Write `image_grid_png(images, columns)` to `path` atomically (a temporary file, then a rename)."""
    from .safe_files.atomic_files import atomic_write

    atomic_write(path, image_grid_png(images, columns))
    return os.fspath(path)


__all__ = [
    "DIFFUSERS_MISSING",
    "classifier_features",
    "denoising_mse_by_timestep_range",
    "frechet_classifier_distance",
    "image_grid_png",
    "noised_batch",
    "require_diffusers",
    "sample_images",
    "sampling_scheduler",
    "save_image_grid",
    "timestep_ranges",
    "training_scheduler",
]
