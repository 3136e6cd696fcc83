"""FSDP: the shipped config's wrapping keeps the stack-shared metric generator out of every block's unit, a model
sharded with FSDP2 saves a checkpoint that loads exactly, and the Accelerate recipe trained on two CPU processes
under that config matches one process with the same global batch (loss, evaluation and gathered parameters)."""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
from conftest import randomize_cross_head, tiny_damcha_gpt2_config, tiny_damcha_llama_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import AutoModelForCausalLM

import damcha_hf

ROOT = Path(__file__).resolve().parent.parent
FSDP_CONFIG = ROOT / "recipes" / "accelerate_configs" / "fsdp.yaml"
HARNESS = Path(__file__).resolve().parent / "fsdp_cpu_harness.py"
RECIPE = ROOT / "recipes" / "train_gpt2_accelerate.py"

# The launcher's reading of each `fsdp_config` key (accelerate/commands/launch.py -> FSDP_* variables -> plugin).
PLUGIN_ARGUMENT = {
    "fsdp_version": "fsdp_version",
    "fsdp_auto_wrap_policy": "auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "fsdp_state_dict_type": "state_dict_type",
    "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
}


def shipped_fsdp_plugin() -> FullyShardedDataParallelPlugin:
    fsdp_config = yaml.safe_load(FSDP_CONFIG.read_text())["fsdp_config"]
    unknown = set(fsdp_config) - set(PLUGIN_ARGUMENT)
    assert not unknown, f"{FSDP_CONFIG.name} has keys this test does not map to the plugin: {unknown}"
    arguments = {PLUGIN_ARGUMENT[key]: value for key, value in fsdp_config.items()}
    if isinstance(arguments.get("auto_wrap_policy"), str):
        arguments["auto_wrap_policy"] = arguments["auto_wrap_policy"].lower()
    return FullyShardedDataParallelPlugin(**arguments)


def wrapped_units(model) -> list[torch.nn.Module]:
    """The modules Accelerate's FSDP2 preparation shards as units of their own under the shipped policy (the root
    is always one more), in the order `fsdp2_prepare_model` visits them."""
    policy = fsdp2_prepare_auto_wrap_policy(shipped_fsdp_plugin(), model)
    assert policy is not None, "the shipped FSDP config has no auto-wrap policy: the whole model would be one unit"
    return [module for module in get_module_children_bottom_up(model)[:-1] if policy(module)]


@pytest.mark.parametrize(
    "config",
    [
        tiny_damcha_gpt2_config(),
        tiny_damcha_gpt2_config(metric_sharing="layer"),
        tiny_damcha_llama_config(),  # grouped-query: 8 query heads, 2 key/value heads
        tiny_damcha_llama_config(metric_sharing="layer"),
    ],
    ids=["gpt2", "gpt2-layer-sharing", "llama-gqa", "llama-layer-sharing"],
)
def test_shipped_fsdp_policy_wraps_each_block_and_leaves_the_generator_in_the_root_unit(config):
    model = AutoModelForCausalLM.from_config(config)
    units = wrapped_units(model)
    blocks = list(model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h)
    assert [id(unit) for unit in units] == [id(block) for block in blocks]
    generator = model.base_model.cross_head_metric
    generator_parameters = {id(parameter) for parameter in generator.parameters()}
    assert generator_parameters
    for unit in units:
        assert not generator_parameters & {id(parameter) for parameter in unit.parameters()}, type(unit).__name__


@pytest.fixture
def single_process_group(tmp_path):
    """A one-process gloo group in this process, so that `fully_shard` runs; destroyed afterwards."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("make_config", [tiny_damcha_gpt2_config, tiny_damcha_llama_config], ids=["gpt2", "llama"])
def test_fsdp_sharded_model_saves_its_own_code_and_loads_exactly(tmp_path, single_process_group, make_config):
    model = AutoModelForCausalLM.from_config(make_config())
    randomize_cross_head(model)
    plain_folder = tmp_path / "plain"
    model.save_pretrained(plain_folder)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for block in model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h:
        fully_shard(block, mesh=single_process_group)
    fully_shard(model, mesh=single_process_group)
    assert isinstance(model, FSDPModule) and type(model).__module__.startswith("torch.")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded_folder = tmp_path / "sharded"
    # Accelerate's documented save: the unwrapped (still FSDP-classed) model with the gathered state dict.
    model.save_pretrained(sharded_folder, state_dict=full)
    assert type(model).__name__.startswith("FSDP")  # the save leaves the wrapper as it was
    assert sorted(os.listdir(sharded_folder)) == sorted(os.listdir(plain_folder))
    saved_config = json.loads((sharded_folder / "config.json").read_text())
    plain_config = json.loads((plain_folder / "config.json").read_text())
    assert saved_config["auto_map"] == plain_config["auto_map"]
    assert saved_config["architectures"] == plain_config["architectures"]
    for loaded in (
        AutoModelForCausalLM.from_pretrained(sharded_folder),
        AutoModelForCausalLM.from_pretrained(sharded_folder, trust_remote_code=True),
    ):
        state = loaded.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name


def _launch(command: list[str], *, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env)


def _accelerate_fsdp(*launch_args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(FSDP_CONFIG),
            "--mixed_precision", "no", "--main_process_port", str(29500 + os.getpid() % 1000), *launch_args]  # fmt: skip


def _corpus(folder: Path) -> str:
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs", "far", "away"]
    path = folder / "corpus.txt"
    path.write_text("".join(" ".join(rng.choice(words, 12)) + "\n" for _ in range(300)))
    return str(path)


def _recipe():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import train_gpt2_accelerate
    finally:
        sys.path.remove(str(RECIPE.parent))
    return train_gpt2_accelerate


@pytest.mark.parametrize("distributed_type", [DistributedType.MULTI_CPU, DistributedType.NO])
def test_recipe_check_refuses_an_fsdp_launch_that_is_not_fsdp(monkeypatch, distributed_type):
    check = _recipe().check_fsdp_runs
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match=r"distributed_type: FSDP.*cpu_ddp_2proc\.yaml"):
        check(SimpleNamespace(distributed_type=distributed_type), DistributedType)
    check(SimpleNamespace(distributed_type=DistributedType.FSDP), DistributedType)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check(SimpleNamespace(distributed_type=distributed_type), DistributedType)


@pytest.mark.slow
def test_recipe_refuses_fsdp_that_accelerate_would_run_as_ddp_on_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with a GPU Accelerate runs FSDP itself; this is the CPU-only refusal")
    completed = _launch([*_accelerate_fsdp(str(RECIPE)), "--data", _corpus(tmp_path), "--max-steps", "1",
                         "--output-dir", str(tmp_path / "run")], timeout=300)  # fmt: skip
    assert completed.returncode != 0
    assert "distributed_type: FSDP" in completed.stderr and "cpu_ddp_2proc.yaml" in completed.stderr
    assert not (tmp_path / "run" / "final").exists()


TINY_RECIPE_ARGS = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--metric-hidden-size",
                    "8", "--learning-rate", "3e-3", "--logging-steps", "1", "--max-steps", "4",
                    "--max-eval-samples", "16", "--num-threads", "1"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_args", [[], ["--model-type", "damcha_llama", "--n-kv-head", "2"]], ids=["gpt2", "llama-gqa"]
)
def test_recipe_under_fsdp_on_two_cpu_processes_matches_one_process(tmp_path, model_args):
    corpus = _corpus(tmp_path)
    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    completed = _launch([*_accelerate_fsdp(str(HARNESS), str(RECIPE)), "--data", corpus, *TINY_RECIPE_ARGS,
                         *model_args, "--batch-size", "4", "--output-dir", str(sharded)])  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    completed = _launch([sys.executable, str(RECIPE), "--data", corpus, *TINY_RECIPE_ARGS, *model_args,
                         "--batch-size", "8", "--output-dir", str(single)])  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]

    def log(folder):
        return json.loads((folder / "checkpoint-4" / "loop_state.json").read_text())["log_history"]

    sharded_log, single_log = log(sharded), log(single)
    assert [entry["step"] for entry in sharded_log] == [entry["step"] for entry in single_log]
    for sharded_entry, single_entry in zip(sharded_log, single_log, strict=True):
        for key in ("loss", "eval_loss"):
            if key in single_entry:
                assert sharded_entry[key] == pytest.approx(single_entry[key], rel=1e-5), (key, sharded_entry["step"])
    assert json.loads((sharded / "eval_results.json").read_text())["num_processes"] == 2

    sharded_model = AutoModelForCausalLM.from_pretrained(sharded / "final")
    single_model = AutoModelForCausalLM.from_pretrained(single / "final")
    assert isinstance(sharded_model, (damcha_hf.DamchaGPT2LMHeadModel, damcha_hf.DamchaLlamaForCausalLM))
    # The checkpoint is exactly the parameters the two processes gathered (their SHA-256, written before saving).
    recipe_checksum = (sharded / "parameter_sha256_rank0.txt").read_text().strip()
    assert not (sharded / "parameter_sha256_rank1.txt").exists()  # rank 1 holds only a shard
    assert _recipe().parameter_sha256(sharded_model) == recipe_checksum
    # The generator trained (its output layer starts at zero), and it trained as in one process.
    single_parameters = dict(single_model.named_parameters())
    generator_names = [name for name, _ in sharded_model.named_parameters() if "cross_head_metric" in name]
    assert any(single_parameters[name].abs().max() > 0 for name in generator_names if name.endswith("fc_out.weight"))
    for name, parameter in sharded_model.named_parameters():
        torch.testing.assert_close(parameter, single_parameters[name], rtol=1e-4, atol=1e-5, msg=name)
