"""`recipes/train_bart.py` (the Seq2SeqTrainer recipe) and the shipped BLEU / chrF / ROUGE modules."""

import json
from pathlib import Path

import pytest
import torch
from conftest import load_recipe

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--ffn-dim", "64", "--bpe-vocab-size", "300",
        "--max-eval-samples", "8", "--batch-size", "4", "--max-source-length", "32", "--max-target-length", "12"]  # fmt: skip


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    """Forty pairs from ten documents: the validation split is held out by document."""
    rows = [{"source": f"def f{index}(x, y={index})", "target": f"Return x plus {index} times y.",
             "document": f"module{index % 10}.py"} for index in range(40)]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("model_type, expected_class", [
    ("damcha_bart", "DamchaBartForConditionalGeneration"),
    pytest.param("bart", "BartForConditionalGeneration", marks=pytest.mark.slow),
])  # fmt: skip
def test_a_quick_run_trains_scores_generations_and_saves_a_loadable_checkpoint(tmp_path, pairs_file, model_type,
                                                                              expected_class):  # fmt: skip
    import transformers

    run = tmp_path / "run"
    results = load_recipe("train_bart").main(["--data", str(pairs_file), "--max-steps", "2", "--model-type", model_type,
                                  "--output-dir", str(run), *TINY])  # fmt: skip
    assert results == json.loads((run / "eval_results.json").read_text())
    assert results["global_step"] == 2 and results["eval_pairs"] == 8
    assert {"eval_loss", "eval_bleu", "eval_chrf", "eval_rouge1", "eval_rouge2", "eval_rougeL"} <= set(results)
    assert 0 <= results["eval_chrf"] <= 100 and 0 <= results["eval_rougeL"] <= 1
    final = run / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == [expected_class]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == expected_class
    assert tokenizer.model_max_length == config["max_position_embeddings"] == 32
    with torch.no_grad():
        generated = model.generate(**tokenizer("def f3(x, y=3)", return_tensors="pt"), max_length=12)
    assert generated.shape[0] == 1 and generated.shape[1] <= 12
    assert "pipeline_tag: text2text-generation" in (final / "README.md").read_text()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--metric-context", "sequence"], "--metric-context sequence"),
        (["--model-type", "bart", "--metric-context", "query"], "--metric-context applies to damcha_bart"),
        (["--heads", "3"], "--heads 3 must divide --d-model 128"),
        (["--data", "missing.jsonl"], "'missing.jsonl' does not exist; use 'stdlib' or a JSON-lines file"),
        (["--cross-attention-metric", "shared"], "invalid choice: 'shared'"),
    ],
)
def test_mistakes_fail_while_parsing_with_the_fix(tmp_path, arguments, message, capsys):
    with pytest.raises(SystemExit) as raised:
        load_recipe("train_bart").parse_args([*arguments, "--output-dir", str(tmp_path / "run")])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shipped_generation_metrics_agree_with_the_libraries_and_with_closed_forms():
    import sacrebleu
    from rouge_score import rouge_scorer

    from damcha_hf.metrics import load_metric

    predictions = ["return the file descriptor", "open a new file named filename", "close it"]
    references = ["Return the file descriptor.", "Open a new file named 'filename'.", "Close the file."]
    scores = load_metric("sacrebleu_scores").compute(predictions=predictions, references=references)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(predictions, [references]).score)
    rouge = load_metric("rouge").compute(predictions=predictions, references=references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    expected = sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / 3
    assert rouge["rougeL"] == pytest.approx(expected)
    # Closed forms: identical texts score 100 / 1; "close it" vs "Close the file." shares 1 of 2 and 1 of 3 unigrams.
    same = load_metric("sacrebleu_scores").compute(predictions=references, references=references)
    assert same["bleu"] == pytest.approx(100) and same["chrf"] == pytest.approx(100)
    single = load_metric("rouge").compute(predictions=["close it"], references=["Close the file."])
    assert single["rouge1"] == pytest.approx(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))


def test_the_lora_recipe_refuses_an_encoder_decoder_while_parsing(tmp_path, capsys):
    lora = load_recipe("finetune_lora")
    base = tmp_path / "bart"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "damcha_bart"}))
    with pytest.raises(SystemExit):
        lora.parse_args(["--base", str(base), "--output-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err
    assert "a BART encoder-decoder" in error and "recipes/train_bart.py" in error
