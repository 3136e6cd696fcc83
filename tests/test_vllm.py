"""vLLM serves a saved DAMCHA decoder of every family, with tokens equal to transformers' greedy `generate`.

Marker `vllm`, outside the default run: `python -m pytest -m vllm` (about 11 minutes on 2 CPU cores). vLLM runs in the
interpreter named by `DAMCHA_VLLM_PYTHON` (a separate virtual environment, docs/serving.md), or in this one where it
imports vLLM; with neither, every test here is skipped, saying so. The checkpoints and the reference tokens are built
here, with the plugin: one per decoder family (GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2), 2 layers of 4
query and 2 key/value heads of width 32 (vLLM's CPU attention needs at least 32), each family's own details switched on
(sliding windows of 4 positions, Qwen2's biases, Qwen3's q/k norms, Phi-3's fused projection and partial rotation,
Gemma 2's soft-caps), a random non-zero metric generator, float32, and a byte-level tokenizer. vLLM loads each with
`trust_remote_code=True` (the plugin need not be installed beside it) and generates greedily: offline with
`LLM.generate` (eager, and compiled for one family), and over loopback with `vllm serve` answering an OpenAI-style
completion request.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers
from conftest import randomize_cross_head, tiny_gpt2_config, tiny_llama_config
from tiny_decoders import tiny_stock_config

import damcha_hf
from damcha_hf.data import byte_level_tokenizer
from damcha_hf.families import family_for_model_type

pytestmark = pytest.mark.vllm

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2")
PROMPTS = (
    "The quick brown fox",
    "DAMCHA mixes the keys across heads, so the paged cache holds mixed keys.",
    "a",
    "Served where people serve models:",
)
NEW_TOKENS = 24
END_OF_TEXT = 256  # the byte-level tokenizer's one special token
RUNNER = Path(__file__).with_name("vllm_runner.py")
SERVER_START_SECONDS = 600
# A float32 greedy choice between two logits closer than this may go either way between two correct implementations
# (different kernels sum in different orders); tokens are compared up to such a near-tie only.
NEAR_TIE = 1e-4


def vllm_python() -> str:
    """The interpreter that runs vLLM: `DAMCHA_VLLM_PYTHON`, else this one if it imports vLLM; else the test skips."""
    named = os.environ.get("DAMCHA_VLLM_PYTHON")
    if named:
        if not Path(named).is_file():
            pytest.fail(f"DAMCHA_VLLM_PYTHON={named!r} is not a file; name the python of an environment with vLLM.")
        return named
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(
            "vLLM is not importable here; install it (docs/serving.md) or set DAMCHA_VLLM_PYTHON to the python of an "
            "environment that has it"
        )
    return sys.executable


def vllm_environment() -> dict:
    # A small KV cache (GiB) and the Hub out of reach: the checkpoints are local.
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def stock_config(model_type: str) -> transformers.PretrainedConfig:
    """The family's tiny config at head width 32, with the byte-level vocabulary and no end-of-text stop."""
    shape = {"vocab_size": 257, "bos_token_id": None, "eos_token_id": None, "pad_token_id": END_OF_TEXT}
    if model_type == "gpt2":  # untied, as Gemma 2 below: tied, these tiny models mostly repeat their last token
        return tiny_gpt2_config(n_embd=128, n_head=4, n_positions=256, tie_word_embeddings=False, **shape)
    decoder = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **shape,
    }
    if model_type == "llama":
        return tiny_llama_config(**decoder)
    own = {"head_dim": 32} if model_type in ("qwen3", "gemma2") else {}
    if model_type == "gemma2":
        # Gemma 2's released soft-cap (50) and initialisation scale: with the tiny configs' (a soft-cap of 1.0, weights
        # of scale 0.5), vLLM 0.32 on a CPU returns token 0 after a few steps for the stock Gemma 2 too.
        own.update(tie_word_embeddings=False, attn_logit_softcapping=50.0, initializer_range=0.02)
    return tiny_stock_config(model_type, **decoder, **own)


def greedy(model, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens for each prompt, and at each step the gap between the two largest logits."""
    tokens, margins = [], []
    for prompt in prompts:
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens.append(output.sequences[0, len(prompt) :].tolist())
        margins.append([float(step[0].topk(2).values.diff().abs()) for step in output.scores])
    return tokens, margins


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Per family: the saved DAMCHA checkpoint, the prompts' token ids, transformers' greedy tokens (and their
    margins) for the DAMCHA model and for the stock model it was converted from (the metric at zero)."""
    vllm_python()  # skip before building anything where vLLM cannot run
    tokenizer = byte_level_tokenizer(256)
    prompts = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    built = {}
    for model_type in FAMILIES:
        family = family_for_model_type(model_type)
        torch.manual_seed(0)
        stock = family.task_head.stock_class(stock_config(model_type)).eval()
        model = damcha_hf.convert_to_damcha(stock).eval()
        randomize_cross_head(model)
        path = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        expected, margins = greedy(model, prompts)
        stock_tokens, _ = greedy(stock, prompts)
        built[model_type] = {
            "path": str(path),
            "prompts": prompts,
            "expected": expected,
            "margins": margins,
            "stock": stock_tokens,
        }
    return built


def assert_tokens_equal(served: list[list[int]], reference: dict, name: str) -> None:
    """Each prompt's tokens equal transformers' up to the first near-tie of the reference's top two logits."""
    assert len(served) == len(reference["expected"])
    for index, (tokens, expected, margins) in enumerate(
        zip(served, reference["expected"], reference["margins"], strict=True)
    ):
        assert len(tokens) == len(expected) == NEW_TOKENS
        differs = next((step for step, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if differs is not None:
            assert margins[differs] < NEAR_TIE, (
                f"{name}, prompt {PROMPTS[index]!r}: vLLM's token {differs} is {tokens[differs]}, transformers' "
                f"{expected[differs]} (top-two logit gap {margins[differs]:.2e}); vLLM {tokens}, transformers {expected}"
            )


def run_offline(requests: dict, enforce_eager: bool, tmp_path: Path) -> dict:
    request = tmp_path / "request.json"
    result = tmp_path / "result.json"
    request.write_text(json.dumps({"enforce_eager": enforce_eager, "max_tokens": NEW_TOKENS, "models": requests}))
    run = subprocess.run(
        [vllm_python(), str(RUNNER), str(request), str(result)],
        capture_output=True,
        text=True,
        env=vllm_environment(),
        timeout=3600,
    )
    assert run.returncode == 0 and result.exists(), f"vLLM's run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    # vLLM's logger writes to stdout, Python's warnings and tracebacks to stderr: the log is both.
    return {**json.loads(result.read_text()), "log": run.stdout + run.stderr}


def test_the_metric_changes_the_greedy_tokens(checkpoints):
    """The comparison can fail: with the metric at zero (the stock model) transformers' tokens differ, so a server
    that dropped the key mixing would not match."""
    for model_type, reference in checkpoints.items():
        assert reference["expected"] != reference["stock"], model_type


def test_offline_greedy_tokens_equal_transformers_for_every_family(checkpoints, tmp_path):
    jobs = {name: {"path": ref["path"], "prompts": ref["prompts"]} for name, ref in checkpoints.items()}
    results = run_offline(jobs, enforce_eager=True, tmp_path=tmp_path)
    problems = []  # every family's outcome is reported, not only the first one's
    for name, reference in checkpoints.items():
        served = results[name]
        try:
            assert not isinstance(served, dict), f"vLLM refused {name}: {served['error']}"
            assert_tokens_equal(served, reference, name)
        except AssertionError as problem:
            problems.append(str(problem))
    assert not problems, "\n".join(problems) + f"\nvLLM's log (end):\n{results['log'][-4000:]}"


def test_offline_compiled_greedy_tokens_equal_transformers(checkpoints, tmp_path):
    """vLLM's default, compiled (torch.compile) forward, for one family: the compiler traces the DAMCHA layers too."""
    reference = checkpoints["llama"]
    results = run_offline({"llama": {"path": reference["path"], "prompts": reference["prompts"]}}, False, tmp_path)
    assert not isinstance(results["llama"], dict), results["llama"]
    assert_tokens_equal(results["llama"], reference, "llama, compiled")


def test_a_setting_vllm_cannot_serve_is_refused_by_the_engine(tmp_path):
    """A checkpoint with the query context: vLLM's worker stops at the plugin's one-line refusal, before serving."""
    vllm_python()
    config = damcha_hf.DamchaLlamaConfig(
        **{**stock_config("llama").to_dict(), "metric_context": "query", "metric_hidden_size": 16}
    )
    damcha_hf.DamchaLlamaForCausalLM(config).save_pretrained(tmp_path / "query")
    byte_level_tokenizer(256).save_pretrained(tmp_path / "query")
    results = run_offline({"query": {"path": str(tmp_path / "query"), "prompts": [[1, 2, 3]]}}, True, tmp_path)
    assert "error" in results["query"]
    assert "vLLM cannot serve `metric_context='query'`" in results["log"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_vllm_serve_answers_a_completion_request_with_transformers_tokens(model_type, checkpoints, tmp_path):
    """vLLM's OpenAI-compatible server (`vllm serve CKPT --trust-remote-code`) on loopback, the model implementation
    left to vLLM (it picks its Transformers backend for remote code), one `/v1/completions` request; the server is
    stopped after."""
    reference = checkpoints[model_type]
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    # `vllm serve CKPT`'s server; vllm-cpu 0.32.0's `vllm` command stops at its own version lookup (it asks for the
    # package `vllm`, installed as `vllm-cpu`), so the server module is run directly, with the same arguments.
    command = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", reference["path"]]
    command += ["--trust-remote-code"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256"]
    command += ["--enforce-eager", "--served-model-name", model_type]
    # Its own process group, so that stopping it stops the engine process it starts too.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_environment(), start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{(tmp_path / 'server.log').read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"vllm serve not ready in {SERVER_START_SECONDS} s"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        answer = post(
            f"{base}/v1/completions",
            {
                "model": model_type,
                "prompt": PROMPTS[0],
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == reference["prompts"][0]
    first = {"expected": reference["expected"][:1], "margins": reference["margins"][:1]}
    assert_tokens_equal([choice["token_ids"]], first, f"{model_type}, vllm serve")
