"""Runs a recipe under Accelerate's FSDP on CPU processes joined over gloo (used by tests/test_fsdp.py).

Accelerate (1.x) enables FSDP only on accelerators: with `cpu=True` its state becomes MULTI_CPU, the FSDP plugin the
launcher configured is dropped and the processes run DDP. torch's FSDP2 (`fully_shard`) itself runs on CPU over gloo,
so this harness hands Accelerate's CPU state the plugin back after the Accelerator is built; `prepare`,
`backward`, `clip_grad_norm_` and `get_state_dict` then take Accelerate's own FSDP2 paths, with the wrapping policy of
the launched config file.

    accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml --mixed_precision no \
        tests/fsdp_cpu_harness.py recipes/train_gpt2_accelerate.py [recipe arguments]
"""

import os
import runpy
import sys

import accelerate
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

build_accelerator = accelerate.Accelerator.__init__


def build_accelerator_with_fsdp_on_cpu(self, *args, **kwargs):
    build_accelerator(self, *args, **kwargs)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if self.state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"the harness expects Accelerate's MULTI_CPU state, got {self.state.distributed_type}")
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment, as Accelerator() builds it
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


accelerate.Accelerator.__init__ = build_accelerator_with_fsdp_on_cpu

if __name__ == "__main__":
    recipe = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(recipe, run_name="__main__")
