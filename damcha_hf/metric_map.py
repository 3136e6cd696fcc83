"""A picture of the learned cross-head metric: each layer's matrix `C` (mean over tokens), as a heatmap.

Every DAMCHA model calls its `CrossHeadMetric` once per layer, with that layer's `layer_idx`, and the call returns the
`C` that layer uses (after the `metric_mask` ablation). `compute_metric_map` records those outputs with forward
hooks while a few inputs run through the model, and averages them over tokens and inputs; `write_metric_map` also
draws one heatmap panel per layer. The *off-diagonal mass* of a layer is

    sum_{i != j} |C_ij| / sum_{i, j} |C_ij|

of its mean matrix: 0 for multi-head attention (`C = I`, a fresh or converted model), 1 when heads score only against
other heads' keys. A diffusion denoiser's `C` depends on the noise level too: its inputs are taken at one `timestep`
(the middle of the usual 1000-step schedule, `DEFAULT_DENOISER_TIMESTEP`, unless the inputs or the caller say). With grouped-query attention (Llama) `C` is `H_kv x H_kv`, or `H x H_kv` for `metric_context="query"`,
whose "diagonal" is the plain-GQA assignment of query head `i` to key head `i // (H / H_kv)`.

Usage:

    from damcha_hf.metric_map import write_metric_map
    result = write_metric_map(model, "metric_heatmap.png", tokenizer=tokenizer)   # built-in input
    print(result.offdiagonal_mass)
"""

from __future__ import annotations

import inspect
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .safe_files import PNG_SOFTWARE
from .safe_files.atomic_files import atomic_path

METRIC_MODULE_NAME = "CrossHeadMetric"  # matched by name: remote-code models define their own copy of the class
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DEFAULT_MAX_TOKENS = 128
# The noise level a diffusion denoiser's metric map is drawn at when neither the inputs nor the caller give one: the
# middle of the usual 1000-step DDPM schedule (`damcha-hf inspect` takes the middle of the checkpoint's own schedule).
DEFAULT_DENOISER_TIMESTEP = 500


@dataclass
class MetricMap:
    """Mean cross-head matrices of one model on some inputs."""

    matrices: torch.Tensor  # (layers, H or H_kv, H_kv), float32 on CPU
    offdiagonal_mass: list[float]  # one per layer
    tokens_seen: list[int]  # how many `C` matrices were averaged for each layer
    panels: int = 0  # heatmap panels drawn (one per layer); 0 until written
    path: Path | None = None
    inputs: str = "the inputs given"  # what the matrices were averaged over, in words (the card says it)
    # One per layer: "0", "1", ... or, for an encoder-decoder, "encoder 0", ..., "decoder 0", ..., "cross-attention 0".
    layer_names: list[str] | None = None

    def __post_init__(self):
        if self.layer_names is None:
            self.layer_names = [str(layer) for layer in range(self.num_layers)]

    @property
    def num_layers(self) -> int:
        return self.matrices.shape[0]

    def summary(self) -> str:
        rows = [
            f"layer {name}: off-diagonal mass {mass:.4f}" for name, mass in zip(self.layer_names, self.offdiagonal_mass)
        ]
        return "\n".join(rows)


def head_diagonal(rows: int, columns: int) -> torch.Tensor:
    """The entries of plain attention's `C`: the identity, or query head `i` -> key head `i // (rows / columns)`."""
    return (torch.arange(rows)[:, None] // (rows // columns) == torch.arange(columns)).to(torch.float32)


def offdiagonal_mass(matrix: torch.Tensor) -> float:
    """`sum_{i != j} |C_ij| / sum |C_ij|` of one `(H, H)` (or `(H, H_kv)`) matrix (0 when it is all zero)."""
    magnitude = matrix.abs()
    total = magnitude.sum()
    if total == 0:
        return 0.0
    # Sum the off-diagonal entries themselves: `total - diagonal` rounds to a tiny nonzero (even negative) value
    # when the off-diagonal part is exactly zero ("diagonal" mask).
    off_diagonal = magnitude * (1 - head_diagonal(*matrix.shape).to(magnitude.device, magnitude.dtype))
    return float(off_diagonal.sum() / total)


def metric_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    modules = [module for module in model.modules() if type(module).__name__ == METRIC_MODULE_NAME]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no `{METRIC_MODULE_NAME}`: the metric map needs a DAMCHA model "
            "(convert a GPT-2, Llama or ViT model with `damcha_hf.convert_to_damcha` first)."
        )
    return modules


def is_vision_model(model: torch.nn.Module) -> bool:
    return getattr(model, "main_input_name", "input_ids") == "pixel_values"


def needs_timestep(model_or_class) -> bool:
    """A diffusion denoiser (model or class): its forward takes the noise level, a required `timestep`, beside the
    images."""
    parameter = inspect.signature(model_or_class.forward).parameters.get("timestep")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def default_text() -> list[str]:
    """A few short passages of Python standard-library source: text every machine has, no download."""
    source = Path(textwrap.__file__).read_text(encoding="utf-8").splitlines()
    code_lines = [line for line in source if line.strip() and not line.lstrip().startswith("#")]
    return ["\n".join(code_lines[start : start + 8]) for start in (20, 60, 100, 140)]


def text_inputs(model, texts: Sequence[str], tokenizer=None, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[dict]:
    """One `{"input_ids": (1, n)}` per text: the tokenizer's ids if given, else UTF-8 bytes (mod the vocabulary)."""
    config = model.config
    limit = min(
        max_tokens, getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", max_tokens)
    )
    inputs = []
    for text in texts:
        if tokenizer is not None:
            ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=limit)["input_ids"]
        else:
            ids = [byte % config.vocab_size for byte in text.encode("utf-8")]
        if ids:
            inputs.append({"input_ids": torch.tensor([ids[:limit]])})
    if not inputs:
        raise ValueError("the metric map needs at least one non-empty text input.")
    return inputs


def image_height_width(config) -> tuple[int, int]:
    """A ViT config's `image_size` as (height, width): an int means a square image."""
    size = config.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def random_image_inputs(model, count: int = 4, seed: int = 0) -> list[dict]:
    """Random pixel values of the configured image size, normalised like ImageNet inputs (mean 0, std 1)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    height, width = image_height_width(config)
    shape = (count, config.num_channels, height, width)
    return [{"pixel_values": torch.randn(shape, generator=generator)}]


def image_folder_inputs(model, folder: Path, image_processor=None, limit: int = 16) -> list[dict]:
    """Images of a folder (sorted, at most `limit`), through the checkpoint's image processor if there is one."""
    from PIL import Image

    paths = sorted(path for path in Path(folder).iterdir() if path.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if not paths:
        raise ValueError(f"--data {folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in this folder.")
    config = model.config
    mode = "L" if config.num_channels == 1 else "RGB"
    images = [Image.open(path).convert(mode) for path in paths]
    if image_processor is not None:
        return [{"pixel_values": image_processor(images=images, return_tensors="pt")["pixel_values"]}]
    height, width = image_height_width(config)
    pixels = torch.stack(
        [torch.from_numpy(np.array(image.resize((width, height)), dtype=np.float32)) for image in images]
    )  # (n, size, size) or (n, size, size, 3)
    pixels = pixels.unsqueeze(1) if pixels.ndim == 3 else pixels.permute(0, 3, 1, 2)
    return [{"pixel_values": pixels / 127.5 - 1.0}]  # [0, 255] -> [-1, 1], ViT's usual normalisation


def default_inputs(model, tokenizer=None) -> list[dict]:
    if is_vision_model(model):
        return random_image_inputs(model)
    return text_inputs(model, default_text(), tokenizer)


def as_model_inputs(model, inputs, tokenizer=None) -> list[dict]:
    """Accepts None (built-in input), a tensor of ids or pixels, a dict of tensors, texts, or a list of dicts."""
    if inputs is None:
        return default_inputs(model, tokenizer)
    if isinstance(inputs, torch.Tensor):
        return [{getattr(model, "main_input_name", "input_ids"): inputs}]
    if isinstance(inputs, dict):
        return [inputs]
    if isinstance(inputs, str):
        return text_inputs(model, [inputs], tokenizer)
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(item, str) for item in inputs):
        return text_inputs(model, inputs, tokenizer)
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(item, dict) for item in inputs):
        return list(inputs)
    raise TypeError(
        "metric-map inputs must be None (built-in input), a tensor, a dict of model inputs, a list of such dicts, "
        f"or a list of texts; got {type(inputs).__name__}."
    )


@torch.no_grad()
def compute_metric_map(
    model: torch.nn.Module, inputs=None, *, tokenizer=None, description: str | None = None, timestep: int | None = None
) -> MetricMap:
    """Run `inputs` through `model` and return each layer's cross-head matrix `C`, averaged over all tokens.

    Inputs run one batch at a time without padding, so every averaged `C` belongs to a real token (or, for
    `metric_context="sequence"`, a real sequence). The model's train/eval mode is restored afterwards. A diffusion
    denoiser's batches without a `timestep` of their own run at `timestep` (default `DEFAULT_DENOISER_TIMESTEP`).
    """
    variant = getattr(model.config, "cross_head_variant", "none")  # a stock transformers config: plain attention
    if variant != "damcha":
        raise ValueError(
            f"{type(model).__name__} runs `cross_head_variant={variant!r}`, which has no cross-head metric C to draw; "
            "the metric map is for `cross_head_variant='damcha'` models."
        )
    batches = as_model_inputs(model, inputs, tokenizer)
    if needs_timestep(model):
        step = DEFAULT_DENOISER_TIMESTEP if timestep is None else timestep
        timestep = step if any("timestep" not in batch for batch in batches) else None  # None: the inputs gave theirs
        batches = [{"timestep": torch.tensor(step), **batch} for batch in batches]  # a batch's own step wins
    elif timestep is not None:
        raise ValueError(f"timestep={timestep}: {type(model).__name__} is not a diffusion denoiser; leave it out.")
    modules = metric_modules(model)
    names, first_slot = metric_layer_names(model, modules)
    num_layers = len(names)
    num_heads, num_key_value_heads = modules[0].num_heads, modules[0].num_key_value_heads  # C's rows and columns
    sums = torch.zeros(num_layers, num_heads, num_key_value_heads, dtype=torch.float64)
    counts = [0] * num_layers

    def record(module, args, kwargs, output):
        layer_idx = args[1] if len(args) > 1 else kwargs.get("layer_idx", 0)
        slot = first_slot[id(module)] + layer_idx
        matrices = output.detach().to(torch.float64).reshape(-1, num_heads, num_key_value_heads)
        sums[slot] += matrices.sum(dim=0).cpu()
        counts[slot] += matrices.shape[0]

    handles = [module.register_forward_hook(record, with_kwargs=True) for module in modules]
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        for batch in batches:
            model(**{name: value.to(device) for name, value in batch.items()})
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    # A decoder run alone (BART's decoder as a language model) leaves its cross-attention layers idle.
    called = [slot for slot, count in enumerate(counts) if count or not names[slot].startswith("cross-attention")]
    names, counts, sums = [names[slot] for slot in called], [counts[slot] for slot in called], sums[called]
    missing = [names[slot] for slot, count in enumerate(counts) if count == 0]
    if missing:
        raise RuntimeError(f"layers {missing} never called the cross-head metric; is this a DAMCHA model?")
    matrices = (sums / torch.tensor(counts, dtype=torch.float64).view(-1, 1, 1)).to(torch.float32)
    described = description or describe_inputs(model, inputs, timestep)
    return MetricMap(matrices, [offdiagonal_mass(matrix) for matrix in matrices], counts, inputs=described,
                     layer_names=names)  # fmt: skip


def metric_layer_names(model: torch.nn.Module, modules: list[torch.nn.Module]) -> tuple[list[str], dict[int, int]]:
    """The name of every layer that calls a metric module, and the first layer slot of each module (by `id`).

    A model with one stack names its layers "0", "1", ...; an encoder-decoder's are "encoder i", "decoder i" and
    "cross-attention i" (its decoder's metric serves the cross-attention layers as layers `L..2L-1`).
    """
    module_names = {id(module): name for name, module in model.named_modules()}
    names, first_slot = [], {}
    for module in modules:
        layer_generators = getattr(module, "layer_generators", None)
        stack_layers = len(layer_generators) // 2 if layer_generators else model.config.num_hidden_layers
        calling_layers = len(layer_generators) if layer_generators else stack_layers
        # "model.encoder.cross_head_metric" -> "encoder"
        stack = module_names[id(module)].rsplit(".", 2)[-2] if len(modules) > 1 else ""
        first_slot[id(module)] = len(names)
        for layer in range(calling_layers):
            if not stack:
                names.append(str(layer))
            else:
                names.append(f"{stack} {layer}" if layer < stack_layers else f"cross-attention {layer - stack_layers}")
    return names, first_slot


def describe_inputs(model, inputs, timestep: int | None = None) -> str:
    """What `compute_metric_map` averaged over, in words: the built-in sample is named so that it can be redrawn."""
    at_timestep = f", at timestep {timestep}" if timestep is not None else ""
    if inputs is not None:
        return "inputs chosen by the program that saved the model" + at_timestep
    if is_vision_model(model):
        sample = f"4 random images of the configured size, seed 0{at_timestep}"
        return f"the built-in sample ({sample}), which `damcha-hf inspect` uses by default"
    return (
        "the built-in sample (4 passages of 8 code lines of Python's own `textwrap.py`), which `damcha-hf inspect` "
        "uses by default"
    )


def colour_limit(matrices: torch.Tensor) -> float:
    """The half-range of the heatmaps' shared colour scale (centred at 0, so layers compare and signs read at a glance).

    It is set by the off-diagonal entries, the cross-head terms DAMCHA learns: scaled to the diagonal (about 1) they
    would be invisible. Diagonal entries beyond it saturate. Without off-diagonal terms, the largest entry sets it.
    """
    off_diagonal = matrices * (1 - head_diagonal(*matrices.shape[-2:]))
    return float(off_diagonal.abs().max()) or float(matrices.abs().max()) or 1.0


def plot_metric_map(metric_map: MetricMap, path: str | os.PathLike, *, title: str | None = None) -> int:
    """Draw one heatmap panel per layer into the PNG `path` (written atomically); returns the panel count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_layers, num_heads, num_key_heads = metric_map.matrices.shape
    columns = min(num_layers, 4)
    rows = -(-num_layers // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(2.6 * columns + 1.0, 2.6 * rows + 0.6), squeeze=False)
    limit = colour_limit(metric_map.matrices)
    panels = 0
    for layer, axis in enumerate(axes.flat):
        if layer >= num_layers:
            figure.delaxes(axis)
            continue
        image = axis.imshow(metric_map.matrices[layer].numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
        layer_name = metric_map.layer_names[layer]
        axis.set_title(f"layer {layer_name}: off-diag {metric_map.offdiagonal_mass[layer]:.1%}", fontsize=9)
        axis.set_xticks(list(range(0, num_key_heads, max(1, num_key_heads // 8))))
        axis.set_yticks(list(range(0, num_heads, max(1, num_heads // 8))))
        if layer + columns >= num_layers:  # bottom panel of its column
            axis.set_xlabel("key head j", fontsize=8)
        if layer % columns == 0:
            axis.set_ylabel("head i", fontsize=8)
        axis.tick_params(labelsize=7)
        panels += 1
    label = "C_ij (diagonal saturates)" if limit < float(metric_map.matrices.abs().max()) else "C_ij"
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=label)
    figure.suptitle(title or "DAMCHA cross-head matrix C (mean over tokens)", fontsize=10)
    path = Path(path)
    try:
        with atomic_path(path) as temporary:
            # The mark by which `damcha-hf inspect --overwrite` knows a picture it may replace.
            figure.savefig(temporary, format="png", dpi=110, metadata={"Software": PNG_SOFTWARE})
    finally:
        plt.close(figure)
    metric_map.panels, metric_map.path = panels, path
    return panels


def write_metric_map(
    model: torch.nn.Module,
    path: str | os.PathLike,
    inputs=None,
    *,
    tokenizer=None,
    title: str | None = None,
    description: str | None = None,
    timestep: int | None = None,
) -> MetricMap:
    """`compute_metric_map` then `plot_metric_map`: returns the matrices, masses, panel count and path.
    `description` says in words what `inputs` are (a model card shows it)."""
    metric_map = compute_metric_map(model, inputs, tokenizer=tokenizer, description=description, timestep=timestep)
    plot_metric_map(metric_map, path, title=title)
    return metric_map


__all__ = [
    "DEFAULT_DENOISER_TIMESTEP",
    "MetricMap",
    "compute_metric_map",
    "needs_timestep",
    "offdiagonal_mass",
    "plot_metric_map",
    "write_metric_map",
]
