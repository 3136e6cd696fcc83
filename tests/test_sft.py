"""TRL's SFTTrainer on a DAMCHA-converted decoder (recipes/train_sft.py): the chat template renders the conversations,
the loss falls on the assistant tokens alone (against a mask computed by hand), packing keeps conversations apart
(the packed loss equals each conversation's own, in float64), full and LoRA fine-tuning (the metric generator trained
in full) save checkpoints that reload with and without the plugin."""

import json

import pytest
import torch
from conftest import load_checkpoints_in_fresh_process, load_recipe, randomize_cross_head
from safetensors.torch import load_file
from tiny_checkpoints import stock_decoder, write_stock_decoder
from transformers import AutoModelForCausalLM, AutoTokenizer

from damcha_hf.data import byte_level_tokenizer

pytest.importorskip("trl", reason="TRL is the `trl` extra (in `dev`)")

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
# The assistant's reply and its end-of-turn token inside {% generation %}: what assistant-only loss trains on.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ message['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUICK = ["--max-steps", "2", "--batch-size", "4", "--logging-steps", "1", "--num-threads", "1",
         "--learning-rate", "1e-2", "--max-length", "64"]  # fmt: skip


def chat_tokenizer():
    """The byte-level tokenizer (ids 0-255 the bytes, 256 end of text) with three role tokens and a chat template."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [USER, ASSISTANT, END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def conversations(count: int = 12) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"add {i} {i % 3}"}, {"role": "assistant", "content": f"{i + i % 3}"},
                      *([{"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}] * (i % 2))]}
        for i in range(count)
    ]  # fmt: skip


def expected_labels(conversation: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(input ids, labels) by hand: each turn's role token, its bytes and the end token; labels keep the assistant's
    bytes and its end token, -100 elsewhere."""
    user, assistant, end = tokenizer.convert_tokens_to_ids([USER, ASSISTANT, END])
    ids, labels = [], []
    for turn in conversation["messages"]:
        content = list(turn["content"].encode())
        if turn["role"] == "assistant":
            ids += [assistant, *content, end]
            labels += [-100, *content, end]
        else:
            ids += [user, *content, end]
            labels += [-100] * (len(content) + 2)
    return ids, labels


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    write_stock_decoder(root / "stock", "qwen2", tokenizer=chat_tokenizer())
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    return root, ["--model-name-or-path", str(root / "stock"), "--train-file", str(chats)]


@pytest.mark.parametrize("packing", [False, True])
def test_the_loss_falls_on_the_assistant_tokens_alone(chat_run, packing, tmp_path):
    root, common = chat_run
    recipe = load_recipe("train_sft")
    args = recipe.parse_args([*common, "--assistant-only-loss", *(["--packing"] if packing else []), *QUICK,
                              "--output-dir", str(tmp_path / "run")])  # fmt: skip
    trainer, tokenizer, train, _ = recipe.build_trainer(args)
    by_hand = sorted(expected_labels(row, tokenizer) for row in train)
    batch = next(iter(trainer.get_train_dataloader()))
    found = []
    for row in range(len(batch["input_ids"])):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        if packing:  # one row of several conversations, each restarting its positions at 0
            starts = [i for i, p in enumerate(batch["position_ids"][row].tolist()) if p == 0] + [len(ids)]
            found += [(ids[s:e], labels[s:e]) for s, e in zip(starts[:-1], starts[1:], strict=True)]
        else:
            length = int(batch["attention_mask"][row].sum())
            assert set(labels[length:]) <= {-100}
            found.append((ids[:length], labels[:length]))
    assert all(sample in by_hand for sample in found) and len(found) == min(len(by_hand), 4 if not packing else 99)
    if not packing:
        return
    # Packed: each conversation attends to itself only, so the packed loss is the mean over every conversation's own
    # assistant tokens, computed one conversation at a time in float64 (a DAMCHA generator away from the identity).
    model = trainer.model.double().eval()
    randomize_cross_head(model)
    with torch.no_grad():
        packed = model(**{key: value for key, value in batch.items()}).loss
        total, count = torch.zeros((), dtype=torch.float64), 0
        for ids, labels in found:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            kept = targets != -100
            total -= torch.log_softmax(logits[kept], -1).gather(-1, targets[kept][:, None]).sum()
            count += int(kept.sum())
        # Without the positions the conversations would see each other: the loss differs, so the check can fail.
        unseparated = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    # transformers' loss function computes in float32 whatever the logits' dtype: float32's tolerances.
    torch.testing.assert_close(packed.double(), total / count, rtol=1.3e-6, atol=1e-5)
    assert abs(unseparated.double() - total / count) > 1e-4


def test_full_sft_saves_a_checkpoint_that_reloads_with_and_without_the_plugin(chat_run, tmp_path):
    root, common = chat_run
    recipe = load_recipe("train_sft")
    metrics = recipe.main([*common, "--assistant-only-loss", "--packing", *QUICK, "--output-dir", str(tmp_path / "r")])
    assert metrics["global_step"] == 2 and metrics["eval_loss"] > 0
    final = tmp_path / "r" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "damcha_qwen2"
    assert AutoTokenizer.from_pretrained(final).chat_template == CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    stock = stock_decoder("qwen2")
    assert not torch.equal(model.model.embed_tokens.weight, stock.model.embed_tokens.weight)  # trained in full
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    (report,) = load_checkpoints_in_fresh_process([(final, {"input_ids": ids}, ["AutoModelForCausalLM"])], tmp_path)
    assert not report["damcha_hf_importable"]
    with torch.no_grad():
        torch.testing.assert_close(report["logits"], model(ids).logits)


def test_lora_sft_trains_the_generator_in_full_and_merges(chat_run, tmp_path):
    root, common = chat_run
    recipe = load_recipe("train_sft")
    recipe.main([*common, "--assistant-only-loss", "--lora", "--lora-rank", "4", *QUICK,
                 "--output-dir", str(tmp_path / "r")])  # fmt: skip
    adapter = tmp_path / "r" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "cross_head_metric" in config["modules_to_save"] and set(config["target_modules"]) >= {"q_proj", "v_proj"}
    saved = load_file(adapter / "adapter_model.safetensors")
    generator_out = [value for name, value in saved.items() if "cross_head_metric" in name and "fc_out.weight" in name]
    assert generator_out and all(value.abs().sum() > 0 for value in generator_out)  # trained from its zero start
    final = tmp_path / "r" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    stock = stock_decoder("qwen2")
    # LoRA leaves every weight outside its targets as it was (the embeddings), and the merge changes the targets.
    assert torch.equal(merged.model.embed_tokens.weight, stock.model.embed_tokens.weight)
    assert not torch.equal(
        merged.model.layers[0].self_attn.q_proj.weight, stock.model.layers[0].self_attn.q_proj.weight
    )
    assert merged.model.cross_head_metric.generators[0].fc_out.weight.abs().sum() > 0
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    (report,) = load_checkpoints_in_fresh_process([(final, {"input_ids": ids}, ["AutoModelForCausalLM"])], tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(report["logits"], merged(ids).logits)
        # The adapter on the converted stock model is the merged model: it carries the trained generator itself.
        from peft import PeftModel

        import damcha_hf

        base = damcha_hf.DamchaQwen2ForCausalLM.from_pretrained(root / "stock")
        adapted = PeftModel.from_pretrained(base, adapter).eval()
        # Merging rounds W + BA once in float32, the adapter adds BA x per call: a few float32 roundings apart.
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-5)


def test_chat_data_and_flags_are_checked_before_any_work(chat_run, tmp_path, capsys):
    root, common = chat_run
    recipe = load_recipe("train_sft")
    no_reply = tmp_path / "no_reply.jsonl"
    no_reply.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "hi"}) + "\n")
    stock = common[1]
    cases = [
        (["--model-name-or-path", stock, "--train-file", str(no_reply)], 'no "assistant" turn'),
        (["--model-name-or-path", stock, "--train-file", str(plain)], 'no "messages" list'),
        ([*common, "--lora-rank", "4"], "--lora-rank applies to LoRA; add --lora"),
        (
            [*common, "--max-length", "4096"],
            "--max-length 4096 exceeds the --model-name-or-path checkpoint's context length",
        ),
        (["--train-file", common[3]], "--model-name-or-path is required"),
    ]
    for index, (flags, expected) in enumerate(cases):
        with pytest.raises(SystemExit) as exit_info:
            recipe.parse_args([*flags, "--output-dir", str(tmp_path / f"run{index}")])
        assert exit_info.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert expected in line, line
        assert not (tmp_path / f"run{index}").exists()


@pytest.mark.slow  # about 20 s on 2 busy cores: the default suite stays near its budget
def test_the_docs_trl_snippet_runs(chat_run, tmp_path):
    """docs/recipes.md's own-script snippet, with the tiny checkpoint for the Hub id, one step for a hundred, on the
    CPU."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root, common = chat_run
    page = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    section = page[page.index("In your own TRL script") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    snippet = snippet.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(common[1])).replace(
        "max_steps=100",
        "max_steps=1, use_cpu=True, bf16=False",  # as the page says for a CPU
    )
    snippet = snippet.replace('"chats.jsonl"', repr(common[3]))
    (tmp_path / "sft.py").write_text(snippet)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    completed = subprocess.run([sys.executable, "sft.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=300, check=False)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    final = tmp_path / "runs" / "sft" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "damcha_qwen2"
    assert AutoTokenizer.from_pretrained(final).chat_template == CHAT_TEMPLATE


def test_prompt_completion_rows_train_on_the_completion_alone(chat_run, tmp_path, capsys):
    root, common = chat_run
    pairs = [{"prompt": row["messages"][:1], "completion": row["messages"][1:2]} for row in conversations()]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    recipe = load_recipe("train_sft")
    flags = ["--model-name-or-path", common[1], "--train-file", str(pairs_file), *QUICK]
    args = recipe.parse_args([*flags, "--output-dir", str(tmp_path / "run")])
    trainer, tokenizer, train, _ = recipe.build_trainer(args)
    by_hand = [expected_labels({"messages": row["prompt"] + row["completion"]}, tokenizer) for row in train]
    batch = next(iter(trainer.get_train_dataloader()))
    for row in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][row].sum())
        found = (batch["input_ids"][row][:length].tolist(), batch["labels"][row][:length].tolist())
        assert found in by_hand and set(batch["labels"][row][length:].tolist()) <= {-100}
    with pytest.raises(SystemExit):  # assistant-only loss is the messages rows' option
        recipe.parse_args([*flags, "--assistant-only-loss", "--output-dir", str(tmp_path / "other")])
    assert "--assistant-only-loss applies to messages rows" in capsys.readouterr().err
