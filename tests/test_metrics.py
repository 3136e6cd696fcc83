"""The evaluate modules shipped in damcha_hf/metrics load by path offline and agree with direct computations."""

import math

import evaluate
import numpy as np
import pytest
import torch

from damcha_hf.metrics import (
    accuracy_compute_metrics,
    causal_lm_compute_metrics,
    causal_lm_token_nll,
    load_metric,
    metric_path,
)


def _direct_nll(logits, labels):
    """Summed next-token NLL (nats) and count, with torch, labels -100 ignored."""
    logits, labels = torch.as_tensor(logits, dtype=torch.float64), torch.as_tensor(labels)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )
    return loss.item(), int((labels[:, 1:] != -100).sum())


@pytest.fixture
def lm_outputs():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 6, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, size=(3, 6))
    labels[1, 3] = -100
    return logits, labels


def test_modules_load_by_path_offline():
    for name in ("accuracy", "perplexity", "bits_per_byte"):
        module = evaluate.load(metric_path(name))
        assert isinstance(module, evaluate.Metric)
    with pytest.raises(ValueError, match="choose one of"):
        metric_path("bleu")


def test_accuracy_matches_numpy():
    rng = np.random.default_rng(1)
    predictions, references = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
    result = load_metric("accuracy").compute(predictions=predictions, references=references)
    assert result["accuracy"] == pytest.approx(np.mean(predictions == references))
    weights = rng.random(50)
    weighted = load_metric("accuracy").compute(predictions=predictions, references=references, sample_weight=weights)
    assert weighted["accuracy"] == pytest.approx(np.sum(weights * (predictions == references)) / weights.sum())


def test_perplexity_from_logits_and_from_nll(lm_outputs):
    logits, labels = lm_outputs
    total, count = _direct_nll(logits, labels)
    result = load_metric("perplexity").compute(predictions=logits, references=labels)
    assert result["num_tokens"] == count == 14
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    from_nll = load_metric("perplexity", "nll").compute(predictions=[total / 2, total / 2], references=[count - 4, 4])
    assert from_nll["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-9)


def test_bits_per_byte_counts_bytes_per_token(lm_outputs):
    logits, labels = lm_outputs
    total, count = _direct_nll(logits, labels)
    byte_lengths = np.arange(11) % 3 + 1
    scored = labels[:, 1:][labels[:, 1:] != -100]
    result = load_metric("bits_per_byte").compute(predictions=logits, references=labels, bytes_per_token=byte_lengths)
    assert result["num_bytes"] == byte_lengths[scored].sum()
    assert result["bits_per_byte"] == pytest.approx(total / math.log(2) / byte_lengths[scored].sum(), rel=1e-5)
    one_byte_each = load_metric("bits_per_byte").compute(predictions=logits, references=labels)
    assert one_byte_each["bits_per_byte"] == pytest.approx(total / count / math.log(2), rel=1e-5)
    from_nll = load_metric("bits_per_byte", "nll").compute(predictions=[total], references=[100])
    assert from_nll["bits_per_byte"] == pytest.approx(total / math.log(2) / 100)


def test_trainer_metric_helpers_agree_with_direct_computation(lm_outputs):
    from transformers import EvalPrediction

    from damcha_hf.data import byte_level_tokenizer

    logits, labels = lm_outputs
    logits = np.concatenate([logits, np.full((3, 6, 257 - 11), -30.0, dtype=np.float32)], axis=-1)
    total, count = _direct_nll(logits, labels)
    nll = causal_lm_token_nll(torch.as_tensor(logits), torch.as_tensor(labels))
    assert nll.shape == (3, 5)
    assert nll.double().sum().item() == pytest.approx(total, rel=1e-5)
    results = causal_lm_compute_metrics(byte_level_tokenizer())(EvalPrediction(nll.numpy(), labels))
    assert results["bits_per_byte"] == pytest.approx(total / count / math.log(2), rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    class_logits = np.array([[0.1, 2.0], [3.0, 0.0], [0.0, 1.0]])
    accuracy = accuracy_compute_metrics()(EvalPrediction(class_logits, np.array([1, 1, 1])))
    assert accuracy["accuracy"] == pytest.approx(2 / 3)
