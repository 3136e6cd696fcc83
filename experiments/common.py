"""Shared by the experiment scripts: the rows of a comparison (MHA, DAMCHA per metric context, the baselines, the
capacity controls), built so that every row of a seed starts from the same weights; the statistics of paired
comparisons; tables, JSON and figures written whole.

Importing this module loads neither torch nor transformers (the scripts answer `--help` at once); the builders import
them when called. The statistics need scipy (`pip install -e ".[experiments]"` in a clone).
"""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass

GPT2_CONTEXTS = ("token", "query")  # "sequence" is refused by causal models (it would leak future tokens)
LLAMA_CONTEXTS = ("token", "query")
VIT_CONTEXTS = ("sequence", "token", "query")


class InputFileError(ValueError):
    """An experiment's input file (a results JSON, a tuning choice) is missing, unreadable or not what it should
    hold: one line naming the flag, the file, what is wrong and what it should hold."""


def json_kind(value) -> str:
    """What a JSON value is, in words: "an object", "a list", "null", ..."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return kinds.get(type(value), "a number")


def read_json_input(path: str, flag: str, *, holds: str, keys: tuple[str, ...] = ()) -> dict:
    """The JSON object in `path`, the input file of an experiment's `flag`; anything else raises `InputFileError` in
    one line: a missing file, a folder, a file that cannot be read, one that is not UTF-8 or not JSON (a truncated
    run), one that holds another kind of value, or one without `keys`. `holds` says what the file should be."""

    def refuse(problem: str):
        raise InputFileError(f"{flag} {path}: {problem}; it should be {holds}")

    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        refuse("no such file")
    except IsADirectoryError:
        refuse("a folder, not a file")
    except OSError as error:
        refuse(f"cannot be read ({error.strerror})")
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        refuse("not UTF-8 text")
    except ValueError as error:
        where = f" ({error.msg}, line {error.lineno} column {error.colno})" if hasattr(error, "msg") else ""
        refuse(f"not valid JSON{where}: a damaged file, or one still being written")
    if not isinstance(data, dict):
        refuse(f"holds {json_kind(data)}, not an object")
    missing = [key for key in keys if key not in data]
    if missing:
        refuse(f"has no {', '.join(map(repr, missing))} {'entry' if len(missing) == 1 else 'entries'}")
    return data


@dataclass
class Row:
    """One model of a comparison: `build()` returns a fresh model in train mode."""

    name: str
    build: Callable[[], object]  # a fresh torch.nn.Module
    kind: str  # "mha", "damcha" or "variant"


def gpt2_config_kwargs(layers: int, width: int, heads: int, positions: int, vocab: int, dropout: float = 0.0) -> dict:
    return {
        "vocab_size": vocab,
        "n_positions": positions,
        "n_embd": width,
        "n_layer": layers,
        "n_head": heads,
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def llama_config_kwargs(
    layers: int,
    positions: int,
    vocab: int = 32000,
    width: int = 2048,
    heads: int = 32,
    kv_heads: int = 4,
    intermediate: int = 5632,
) -> dict:
    """A Llama config; the defaults are TinyLlama-1.1B's widths (32 query heads sharing 4 key/value heads)."""
    return {
        "vocab_size": vocab,
        "max_position_embeddings": positions,
        "hidden_size": width,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def vit_config_kwargs(image_size, patch_size, channels, layers, width, heads, labels, dropout=0.0) -> dict:
    return {
        "image_size": image_size,
        "patch_size": patch_size,
        "num_channels": channels,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * width,
        "num_labels": labels,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
    }


def _paired(damcha, reference):
    """Copy every weight of the MHA `reference` into `damcha`, so both start from the same point (paired seeds).

    Keys only DAMCHA has (its metric generator, a variant's mixing weights) keep their own init; a reference key that
    DAMCHA lacks would mean a weight silently dropped, and is an error.
    """
    _, unexpected = damcha.load_state_dict(reference.state_dict(), strict=False)
    if unexpected:
        raise RuntimeError(f"weights of the MHA model have no place in {type(damcha).__name__}: {unexpected[:4]}")
    return damcha


def gpt2_rows(config_kwargs: dict, *, contexts=GPT2_CONTEXTS, **options) -> list[Row]:
    """MHA (vanilla `GPT2LMHeadModel`), DAMCHA per `metric_context`, the baseline variants and the capacity controls
    (widened to DAMCHA `"token"`'s parameter count, and to DCMHA's); `options` as in `_stock_and_damcha_rows`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import damcha_hf

    classes = (GPT2Config, GPT2LMHeadModel, damcha_hf.DamchaGPT2Config, damcha_hf.DamchaGPT2LMHeadModel)
    mlp = ("n_inner", 4 * config_kwargs["n_embd"])
    return _stock_and_damcha_rows(classes, config_kwargs, mlp, contexts, "token", **options)


def _stock_and_damcha_rows(
    classes: tuple,
    config_kwargs: dict,
    mlp: tuple[str, int],
    contexts,
    default_context: str,
    *,
    metric_hidden_size: int = 64,
    seed: int = 0,
    variants: bool = True,
    attn_implementation: str = "sdpa",
    parameter_matched_mha: bool = False,
    dcmha_matched_mha: bool = False,
    scores_form: bool = False,
    damcha_options: dict | None = None,
) -> list[Row]:
    """The rows of one family: `classes` = (stock config, stock model, DAMCHA config, DAMCHA model), `mlp` = (the
    config field of the MLP width, its value).

    Every model built for the same `seed` starts from the same stock weights; DAMCHA's metric generator starts at
    zero (its input layer from a seeded normal), so at step 0 every row computes the same function.
    `parameter_matched_mha` adds "MHA +params": the stock model with its MLPs widened until it has as many parameters
    as DAMCHA with `default_context` (to the nearest MLP unit), the control for DAMCHA's generator parameters;
    `dcmha_matched_mha` adds "MHA +DCMHA params", widened to DCMHA's count, the control for its dynamic projections.
    `scores_form` adds "DAMCHA scores <context>" per context: the second reading of the metric (`metric_form="scores"`,
    eager attention), with the same parameters and starting function as the first. `damcha_options` are further
    config fields of every DAMCHA row (e.g. `metric_input_norm`).
    """
    import torch

    config_class, model_class, damcha_config_class, damcha_model_class = classes

    def mha(implementation=attn_implementation):
        torch.manual_seed(seed)
        return model_class(config_class(**config_kwargs, attn_implementation=implementation)).train()

    def damcha(implementation=attn_implementation, **options):
        def build():
            reference = mha(implementation)
            torch.manual_seed(seed + 1)
            config = damcha_config_class(**config_kwargs, metric_hidden_size=metric_hidden_size,
                                         attn_implementation=implementation, **(damcha_options or {}), **options)  # fmt: skip
            return _paired(damcha_model_class(config), reference).train()

        return build

    def widened(inner):
        torch.manual_seed(seed)
        return model_class(config_class(**{**config_kwargs, mlp[0]: inner}, attn_implementation="sdpa")).train()

    rows = [Row("MHA", mha, "mha")]
    rows += _capacity_controls(
        mha, widened, mlp[1], damcha(metric_context=default_context),
        parameter_matched_mha=parameter_matched_mha, dcmha_matched_mha=dcmha_matched_mha,
    )  # fmt: skip
    rows += [Row(f"DAMCHA {context}", damcha(metric_context=context), "damcha") for context in contexts]
    if scores_form:
        rows += [
            Row(f"DAMCHA scores {context}", damcha("eager", metric_context=context, metric_form="scores"), "damcha")
            for context in contexts
        ]
    if variants:
        rows += _variant_rows(mha, damcha, default_context)
    return rows


def llama_rows(
    config_kwargs: dict,
    *,
    contexts=LLAMA_CONTEXTS,
    metric_hidden_size: int = 64,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> list[Row]:
    """MHA (stock `LlamaForCausalLM`, grouped-query when `num_key_value_heads` < heads) and DAMCHA per context,
    converted from the same stock weights (`convert_to_damcha`: every weight kept, generator at zero)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import damcha_hf

    def mha(implementation=attn_implementation):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**config_kwargs, attn_implementation=implementation)).train()

    def damcha(**options):
        def build():
            reference = mha()
            torch.manual_seed(seed + 1)
            return damcha_hf.convert_to_damcha(reference, metric_hidden_size=metric_hidden_size, **options).train()

        return build

    return [Row("MHA", mha, "mha")] + [
        Row(f"DAMCHA {context}", damcha(metric_context=context), "damcha") for context in contexts
    ]


def _capacity_controls(mha, widened, mlp_width, method, *, parameter_matched_mha, dcmha_matched_mha) -> list[Row]:
    """The capacity controls: vanilla MHA with its MLPs widened by as many units as hold a method's extra parameters
    (to the nearest unit). "MHA +params" matches DAMCHA (`method`), "MHA +DCMHA params" the seed's MHA converted to
    DCMHA. `widened(inner)` builds the vanilla model with MLP width `inner`; the count is taken from built models."""

    def matched(method_build):
        def build():
            reference = mha()
            extra = count_parameters(method_build()) - count_parameters(reference)
            per_unit = count_parameters(widened(mlp_width + 1)) - count_parameters(reference)  # one more MLP unit
            return widened(mlp_width + round(extra / per_unit))

        return build

    def dcmha():
        import damcha_hf

        return damcha_hf.convert_to_damcha(mha(), cross_head_variant="dcmha")

    rows = []
    if parameter_matched_mha:
        rows.append(Row("MHA +params", matched(method), "mha"))
    if dcmha_matched_mha:
        rows.append(Row("MHA +DCMHA params", matched(dcmha), "mha"))
    return rows


def _variant_rows(mha, damcha, context) -> list[Row]:
    """A row per baseline every DAMCHA config offers; the score-mixing ones run on eager attention (they cannot use
    SDPA), so an eager MHA row is added as their like-for-like reference."""
    from damcha_hf.modeling.variants import CROSS_HEAD_VARIANTS, DEFAULT_VARIANT, eager_only_variants

    eager_only = eager_only_variants()
    variants = [variant for variant in CROSS_HEAD_VARIANTS if variant != DEFAULT_VARIANT]
    rows = []
    if any(v in eager_only for v in variants):
        rows.append(Row("MHA (eager)", lambda: mha("eager"), "mha"))
    for variant in variants:
        implementation = "eager" if variant in eager_only else None
        options = {"metric_context": context, "cross_head_variant": variant}
        build = damcha("eager", **options) if implementation else damcha(**options)
        rows.append(Row(f"variant {variant}" + (" (eager)" if implementation else ""), build, "variant"))
    return rows


def vit_rows(config_kwargs: dict, *, contexts=VIT_CONTEXTS, **options) -> list[Row]:
    """MHA (vanilla `ViTForImageClassification`), DAMCHA per context, the baseline variants, and the capacity controls
    (widened to DAMCHA `"sequence"`'s parameter count, and to DCMHA's)."""
    from transformers import ViTConfig, ViTForImageClassification

    import damcha_hf

    classes = (
        ViTConfig,
        ViTForImageClassification,
        damcha_hf.DamchaViTConfig,
        damcha_hf.DamchaViTForImageClassification,
    )
    mlp = ("intermediate_size", config_kwargs["intermediate_size"])
    return _stock_and_damcha_rows(classes, config_kwargs, mlp, contexts, "sequence", **options)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def median(values):
    return statistics.median(values) if values else float("nan")


def save_figure_atomic(figure, path: str) -> None:
    """`figure.savefig` as a PNG, written under a temporary name and renamed onto `path` (`atomic_path`)."""
    from damcha_hf.safe_files.atomic_files import atomic_path

    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")


def format_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = column_widths(headers, cells)

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


# The width every printed table and line of the experiments fits: a terminal, a log, a code block on GitHub.
TEXT_WIDTH = 120


def column_widths(headers: list[str], cells: list[list[str]]) -> list[int]:
    return [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]


def format_tables(headers: list[str], rows: list[list], width: int = TEXT_WIDTH, keys: int = 1) -> str:
    """`format_table`, split by columns into as many tables as it takes for each to fit `width` characters (where
    a column allows); every table repeats the first `keys` columns (what names a row)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = column_widths(headers, cells)

    def table_width(columns):  # a markdown table of columns of widths w is sum(w) + 3 * columns + 1 characters wide
        return sum(widths[i] for i in columns) + 3 * len(columns) + 1

    key_columns = list(range(min(keys, len(headers))))
    groups, current = [], list(key_columns)
    for index in range(len(key_columns), len(headers)):
        if len(current) > len(key_columns) and table_width(current + [index]) > width:
            groups.append(current)
            current = list(key_columns)
        current.append(index)
    groups.append(current)
    return "\n\n".join(
        format_table([headers[i] for i in group], [[row[i] for i in group] for row in cells]) for group in groups
    )


def wrapped(text: str, width: int = TEXT_WIDTH, indent: str = "    ") -> str:
    """Each line of `text` folded at `width` characters, continuation lines indented."""
    import textwrap

    return "\n".join(
        textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) if len(line) > width else line
        for line in text.splitlines()
    )


def set_up_device(device_name: str | None, threads: int):
    """The torch device (default: CUDA if there is one), with `threads` CPU threads, and a one-line description of
    the machine for the reports."""
    import torch

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(threads)
    if device.type == "cuda":
        return device, torch.cuda.get_device_name(device)
    # The model and the instruction set torch dispatches its kernels for: two CPUs that differ in either may round a
    # matrix product differently, so runs of the same settings and seed can agree only on the same kind of CPU.
    capability = torch.backends.cpu.get_cpu_capability()
    return device, (f"CPU {platform.processor() or platform.machine()}{cpu_model()} ({capability} kernels), "
                    f"{torch.get_num_threads()} torch threads")  # fmt: skip


def cpu_model() -> str:
    """ ", <model name>" from /proc/cpuinfo where there is one (Linux), else ""."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return ", " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# ----------------------------------------------------------------------------------------------------- statistics

CONFIDENCE = 0.95


def paired_statistics(differences: list[float], confidence: float = CONFIDENCE) -> dict:
    """Mean of per-seed paired differences, its standard error (sample std / sqrt(n)), the two-sided Student-t
    interval with n - 1 degrees of freedom, the two-sided p-value of the paired t-test of a zero mean, and how many
    seeds share the mean's sign."""
    n = len(differences)
    mean = statistics.fmean(differences)
    std = statistics.stdev(differences) if n > 1 else 0.0
    stats = {"n": n, "mean": mean, "std": std, "per_seed": list(differences),
             "agree_in_sign": sum(1 for d in differences if d * mean > 0)}  # fmt: skip
    if n < 2:
        return {**stats, "se": None, "t_critical": None, "low": None, "high": None, "p_value": None}
    from scipy.stats import t

    se = std / n**0.5
    t_critical = float(t.ppf(0.5 + confidence / 2, n - 1))
    # every seed giving the same difference (se 0) is certain evidence if it is not zero, and none if it is
    p_value = float(2 * t.sf(abs(mean) / se, n - 1)) if se > 0 else float(mean == 0)
    return {**stats, "se": se, "t_critical": t_critical, "low": mean - t_critical * se, "high": mean + t_critical * se,
            "p_value": p_value}  # fmt: skip


def fmt_paired(stats: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    """mean ± SE [interval] (k/n same sign), or mean (1 seed)."""
    if not stats:
        return "-"
    if stats.get("se") is None:
        return f"{scale * stats['mean']:+.{digits}f} (1 seed)"
    low, high = sorted((scale * stats["low"], scale * stats["high"]))
    return (f"{scale * stats['mean']:+.{digits}f} ± {abs(scale) * stats['se']:.{digits}f} "
            f"[{low:+.{digits}f}, {high:+.{digits}f}] ({stats['agree_in_sign']}/{stats['n']})")  # fmt: skip


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their given order: the i-th smallest is multiplied by
    (m - i + 1), made non-decreasing along that order and capped at 1. A comparison whose adjusted p-value is below
    alpha is significant with the family-wise error rate held at alpha, whatever the dependence between them."""
    m = len(p_values)
    adjusted, running = [0.0] * m, 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def multiple_comparisons(comparisons: list[dict], alpha: float = 1 - CONFIDENCE) -> dict:
    """Treats `comparisons` (paired_statistics results) as one family: adds each one's Holm-adjusted p-value
    (`p_holm`) and returns the family's count, how many intervals exclude zero, how many would by chance alone if no
    difference were real (alpha x count), and how many stay significant after Holm's correction."""
    tested = [c for c in comparisons if c.get("p_value") is not None]
    for comparison, adjusted in zip(tested, holm_adjusted([c["p_value"] for c in tested])):
        comparison["p_holm"] = adjusted
    return {"comparisons": len(tested), "alpha": alpha,
            "intervals_excluding_zero": sum(1 for c in tested if c["low"] > 0 or c["high"] < 0),
            "expected_by_chance": alpha * len(tested),
            "significant_after_holm": sum(1 for c in tested if c["p_holm"] < alpha)}  # fmt: skip


def multiple_comparisons_sentence(family: dict) -> str:
    """One sentence a table can end with: the family's size and what survives Holm's correction."""
    return (f"{family['comparisons']} comparisons; intervals excluding zero: {family['intervals_excluding_zero']} "
            f"(about {family['expected_by_chance']:.1f} by chance alone if no difference were real); Holm's correction "
            f"for the {family['comparisons']} at {family['alpha']:.0%} family-wise keeps "
            f"{family['significant_after_holm']} of them.")  # fmt: skip


def bootstrap_median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the median of `values` (10,000 resamples, a fixed seed, so that a summary
    printed twice reads the same); None for fewer than two values."""
    if len(values) < 2:
        return None
    import numpy as np
    from scipy.stats import bootstrap

    result = bootstrap((np.asarray(values),), np.median, confidence_level=confidence, n_resamples=10_000,
                       method="percentile", rng=np.random.default_rng(0))  # fmt: skip
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def interval_verdict(interval: tuple[float, float] | None, reference: float) -> str:
    """The verdict on an interval: "resolved" only where it excludes `reference` (and on which side)."""
    if interval is None:
        return "not resolved (fewer than 2 rounds)"
    if interval[0] > reference:
        return f"resolved: above {reference:g}"
    if interval[1] < reference:
        return f"resolved: below {reference:g}"
    return f"not resolved: the interval contains {reference:g}"


def noise_floor(interval: tuple[float, float] | None) -> float | None:
    """How far from 1 the interval of a ratio of two identical models reaches (a model timed against a second,
    identical one in the same rounds): the timing noise of the machine, in ratio units; None without an interval."""
    if interval is None:
        return None
    return max(abs(interval[0] - 1.0), abs(interval[1] - 1.0))


def floor_verdict(interval: tuple[float, float] | None, reference: float, floor: float | None) -> str:
    """The verdict on a ratio's interval, against `reference`, given the noise floor `floor` of the same rounds
    (`noise_floor`): "resolved" only where the interval lies beyond `reference` by more than the floor, on one side.

    An interval that excludes `reference` by less than the floor is load noise as far as this run can tell: two
    identical models differed by as much. `floor` None (a run without the second identical model) leaves the plain
    interval verdict, which says so."""
    if interval is None:
        return "not resolved (fewer than 2 rounds)"
    if floor is None:
        return f"{interval_verdict(interval, reference)} (no MHA-vs-MHA noise floor in this run)"
    if interval[0] > reference + floor:
        return f"resolved: above {reference:g}, beyond the MHA-vs-MHA noise floor ±{floor:.3f}"
    if interval[1] < reference - floor:
        return f"resolved: below {reference:g}, beyond the MHA-vs-MHA noise floor ±{floor:.3f}"
    if interval[0] > reference or interval[1] < reference:
        return f"not resolved: within the MHA-vs-MHA noise floor ±{floor:.3f}"
    return f"not resolved: the interval contains {reference:g}"


def rounds_for_interval(confidence: float = CONFIDENCE) -> int:
    """The fewest rounds from which an interval of a median can reach `confidence` coverage.

    Whatever the distribution, the true median lies outside [min, max] of n rounds only when every round falls on one
    side of it: probability 2 x 2^-n, so the widest interval the rounds can give covers with 1 - 2^(1-n) (3 rounds:
    75%). A percentile bootstrap of the median never reaches beyond that range, so below this count no interval it
    gives is a `confidence` interval."""
    n = 1
    while 1 - 2.0 ** (1 - n) < confidence:
        n += 1
    return n


def too_few_rounds_sentence(rounds: int, confidence: float = CONFIDENCE) -> str:
    """Why ratios of `rounds` rounds are printed without verdicts: one line."""
    return (f"No verdicts: from {rounds} rounds even the min-max range covers a median with only "
            f"{1 - 2.0 ** (1 - rounds):.0%} probability, not {confidence:.0%}; {rounds_for_interval(confidence)} rounds "
            f"are the fewest that can (--repeats).")  # fmt: skip


# ------------------------------------------------------------------------------------------------ wording of results
# The one place the report's words for a paired difference come from: "ahead" and "behind" only where the interval
# excludes zero; otherwise "no difference resolved", with the interval beside it. Words that read as a result where
# none is resolved ("level", "tie", "leads", "trails", "matches") are never generated.

UNRESOLVED = "no difference resolved"
FORBIDDEN_FOR_UNRESOLVED = ("level", "tie", "tied", "leads", "trails", "matches", "on par")


def is_resolved(stats: dict | None) -> bool:
    """Whether the paired difference's interval excludes zero (two or more seeds)."""
    return bool(stats) and stats.get("low") is not None and (stats["low"] > 0 or stats["high"] < 0)


def interval_cell(stats: dict, scale: float = 1.0, digits: int = 3, agreement: bool = True) -> str:
    """mean [95% interval] (k/n): the short form of `fmt_paired` a sentence quotes."""
    low, high = sorted((scale * stats["low"], scale * stats["high"]))
    agree = f" ({stats['agree_in_sign']}/{stats['n']})" if agreement else ""
    return f"{scale * stats['mean']:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]{agree}"


def direction(stats: dict, lower_is_better: bool) -> str:
    """ "ahead" or "behind" for a resolved difference (row − reference), `UNRESOLVED` otherwise."""
    if not is_resolved(stats):
        return UNRESOLVED
    return "ahead" if (stats["mean"] < 0) == lower_is_better else "behind"


def holm_clause(stats: dict) -> str:
    if stats.get("p_holm") is None:
        return ""
    kept = "kept" if stats["p_holm"] < 1 - CONFIDENCE else "not kept"
    return f"; Holm p {stats['p_holm']:.3f}, {kept}"


def difference_sentence(row: str, reference: str, stats: dict, *, lower_is_better: bool, scale: float = 1.0,
                        digits: int = 3, unit: str = "", holm: bool = False, agreement: bool = True) -> str:  # fmt: skip
    """One clause on a paired difference row − reference: "<row> is ahead of <reference>: ..." or "<row> is behind
    <reference>: ..." (resolved) or "<row> − <reference>: no difference resolved, ..." (the interval contains zero).
    `holm` adds the Holm-adjusted p-value where the comparison has one (`multiple_comparisons`); `agreement` the count
    of seeds agreeing in sign."""
    cell = interval_cell(stats, scale, digits, agreement) + (f" {unit}" if unit else "")
    extra = holm_clause(stats) if holm else ""
    word = direction(stats, lower_is_better)
    if word == UNRESOLVED:
        return f"{row} − {reference}: {UNRESOLVED}, {cell}{extra}"
    return f"{row} is {'ahead of' if word == 'ahead' else 'behind'} {reference}: {cell}{extra}"


def verdict_cell(stats: dict, lower_is_better: bool) -> str:
    """The verdict column of a comparison table: **ahead** / **behind** (resolved) or `UNRESOLVED`."""
    word = direction(stats, lower_is_better)
    return UNRESOLVED if word == UNRESOLVED else f"**{word}**"
