"""recipes/train_diffusion.py end to end on a tiny generated image folder: the noise-prediction loss goes down, resume
continues at the saved step with the same losses, every checkpoint holds its sample grid and schedule, the final
folder loads with AutoModel and diffusers' DDIM scheduler and reproduces the reported samples and FCD, and bad
arguments are refused at parse time."""

import io
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_loss_goes_down, load_recipe, losses, trainer_state, write_fashion_mnist
from PIL import Image
from transformers import AutoModel

import damcha_hf
from damcha_hf import diffusion

REPOSITORY = Path(__file__).resolve().parents[1]

TINY_ARGS = ["--image-size", "8", "--patch-size", "2", "--hidden-size", "16", "--num-layers", "1", "--num-heads", "2",
             "--metric-hidden-size", "4", "--batch-size", "8", "--max-steps", "6", "--save-steps", "3",
             "--eval-steps", "3", "--logging-steps", "1", "--learning-rate", "3e-3", "--num-threads", "1",
             "--num-samples", "4", "--sample-steps", "3", "--num-train-timesteps", "100"]  # fmt: skip


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> str:
    """Two classes of 8x8 grey images, dark and bright."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for label, level in (("dark", 40), ("bright", 210)):
        (root / label).mkdir()
        for i in range(12):
            Image.fromarray(np.clip(rng.normal(level, 20, (8, 8)), 0, 255).astype(np.uint8)).save(
                root / label / f"{i}.png"
            )
    return str(root)


@pytest.fixture(scope="module")
def feature_classifier(tmp_path_factory) -> str:
    """A (random) ViT classifier of 8x8 grey images, as train_vit.py would save one."""
    torch.manual_seed(0)
    config = damcha_hf.DamchaViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                       image_size=8, patch_size=2, num_channels=1, num_labels=2)  # fmt: skip
    folder = tmp_path_factory.mktemp("classifier")
    damcha_hf.DamchaViTForImageClassification(config).save_pretrained(folder)
    return str(folder)


def test_train_diffusion_learns_resumes_and_saves_a_loadable_sampler(tmp_path, image_folder, feature_classifier):
    recipe = load_recipe("train_diffusion")
    args = [*TINY_ARGS, "--data", image_folder, "--feature-classifier", feature_classifier, "--fcd-samples", "6"]
    full = recipe.main([*args, "--output-dir", str(tmp_path / "full")])
    assert full["global_step"] == 6
    uninterrupted = losses(trainer_state(tmp_path / "full" / "checkpoint-6")["log_history"])
    assert_loss_goes_down(uninterrupted)
    assert set(full) >= {"eval_mse_t00-24", "eval_mse_t75-99", "eval_mse", "eval_fcd"} and full["eval_fcd"] >= 0
    assert 2 <= full["eval_fcd_samples"] <= 6  # at most the held-out images the folder's validation split has
    for step in (3, 6):
        checkpoint = tmp_path / "full" / f"checkpoint-{step}"
        assert Image.open(checkpoint / "sample_grid.png").size == (2 + 2 * 10, 2 + 2 * 10)  # 2 x 2 images of 8 px
        assert json.loads((checkpoint / "scheduler_config.json").read_text())["num_train_timesteps"] == 100

    final = tmp_path / "full" / "final"
    model = AutoModel.from_pretrained(final).eval()
    assert isinstance(model, damcha_hf.DamchaViTDenoiserModel) and model.config.image_size == 8
    scheduler = diffusion.training_scheduler(100)
    assert type(diffusion.sampling_scheduler(scheduler)).from_pretrained(final).config.num_train_timesteps == 100
    # The reported samples and FCD follow from the saved model and the fixed evaluation seed.
    samples = diffusion.sample_images(model, scheduler, 6, num_inference_steps=3,
                                      generator=recipe.evaluation_generator())  # fmt: skip
    grid = np.asarray(Image.open(final / "sample_grid.png"))
    expected_grid = np.asarray(Image.open(io.BytesIO(diffusion.image_grid_png(samples[:4]))))
    np.testing.assert_array_equal(grid, expected_grid)
    card = (final / "README.md").read_text()
    assert "## Samples" in card and "(sample_grid.png)" in card and "3 steps" in card
    assert json.loads((tmp_path / "full" / "eval_results.json").read_text())["eval_fcd"] == full["eval_fcd"]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = recipe.main([*TINY_ARGS, "--data", image_folder, "--output-dir", str(resumed_dir), "--resume"])
    assert resumed["global_step"] == 6
    after_resume = losses(trainer_state(resumed_dir / "checkpoint-6")["log_history"])
    for step in (4, 5, 6):
        assert after_resume[step] == pytest.approx(uninterrupted[step], rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [(["--patch-size", "3"], "--patch-size 3 must divide the image size (8)"),
     (["--num-heads", "3"], "--num-heads"),
     (["--feature-classifier", "no-such-folder"], "--feature-classifier no-such-folder: no such checkpoint folder"),
     (["--beta-schedule", "cubic"], "invalid choice: 'cubic'")],
)  # fmt: skip
def test_bad_arguments_are_refused_before_any_data_is_read(tmp_path, image_folder, capsys, extra, message):
    recipe = load_recipe("train_diffusion")
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args([*TINY_ARGS, "--data", image_folder, "--output-dir", str(tmp_path / "run"), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_earlier_run_is_refused_without_overwrite(tmp_path, image_folder, capsys):
    (tmp_path / "run" / "final").mkdir(parents=True)
    with pytest.raises(SystemExit):
        load_recipe("train_diffusion").parse_args([*TINY_ARGS, "--data", image_folder, "--output-dir",
                                                   str(tmp_path / "run")])  # fmt: skip
    assert "holds an earlier run" in capsys.readouterr().err


def test_every_compared_method_starts_from_the_seeds_mha_denoiser(tmp_path):
    """experiments/diffusion.py pairs methods by seed: each trains `--init-from` the seed's MHA denoiser, and at the
    start every method computes exactly that denoiser's function."""
    sys.path.insert(0, str(REPOSITORY))
    from experiments import diffusion as comparison

    args = comparison.parse_args(["--feature-classifier", str(tmp_path), "--runs-dir", str(tmp_path / "runs"),
                                  "--hidden-size", "16", "--num-heads", "2", "--num-layers", "1"])  # fmt: skip
    folder = comparison.initial_model(args, seed=3)
    recipe = load_recipe("train_diffusion")
    # The recipe's default data is Fashion-MNIST, whose folder parsing checks.
    fashion_mnist = ["--fashion-mnist-dir", write_fashion_mnist(tmp_path / "fashion-mnist")]
    pixel_values, timestep = torch.randn(2, 1, 28, 28), torch.tensor([5, 700])
    outputs = {}
    for method, flags in comparison.METHODS.items():
        recipe_args = recipe.parse_args(["--init-from", folder, *flags, *fashion_mnist, "--output-dir",
                                         str(tmp_path / method)])  # fmt: skip
        model = recipe.build_model(recipe_args, channels=1, image_size=28).eval()
        assert model.config.cross_head_variant == flags[1]
        with torch.no_grad():
            outputs[method] = model(pixel_values, timestep).sample
    for method in ("DAMCHA", "DCMHA"):
        torch.testing.assert_close(outputs[method], outputs["MHA"], rtol=0, atol=1e-6)


def test_the_comparison_summary_is_the_paired_statistics_of_the_runs():
    sys.path.insert(0, str(REPOSITORY))
    from experiments import diffusion as comparison

    def run(fcd, mse):
        return {"metrics": {"fcd": fcd, "mse": mse}}

    records = {"MHA": {0: run(10.0, 0.20), 1: run(12.0, 0.22), 2: run(11.0, 0.21)},
               "DAMCHA": {0: run(9.0, 0.19), 1: run(11.5, 0.22), 2: run(9.5, 0.20)}}  # fmt: skip
    summary = comparison.summarize(records)
    differences = [-1.0, -0.5, -1.5]
    against = summary["against_mha"]["DAMCHA"]["fcd"]
    assert against["mean"] == pytest.approx(-1.0) and against["per_seed"] == pytest.approx(differences)
    assert against["se"] == pytest.approx(0.5 / math.sqrt(3))
    assert against["high"] == pytest.approx(-1.0 + 4.302652729911275 * 0.5 / math.sqrt(3))  # t(0.975, 2 d.o.f.)
    assert summary["per_method"]["MHA"]["mse"]["mean"] == pytest.approx(0.21)
