"""The timing half of `experiments/vllm_serving.py`, run in the interpreter that has vLLM: `python
experiments/vllm_serving_worker.py REQUEST.json RESULT.json`.

It builds one vLLM engine per row of the request (the stock model in vLLM's own implementation, the stock model and
the DAMCHA model in vLLM's Transformers backend), all alive at once, warms each, then runs paired rounds: in each
round every engine generates the same batch (greedy, a fixed number of new tokens, no early stop), in an order that
rotates from round to round, so that a drift in the machine's load falls on every row alike. Per call it records the
wall time and the CPU time of the engine's processes (the engine core and its worker) and of this process. Imports only
vLLM, psutil (a vLLM dependency) and the standard library.
"""

import gc
import json
import os
import sys
import time


def process_tree_cpu_seconds(processes) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except Exception:  # a process that has exited counts nothing more
            continue
        total += times.user + times.system
    return total


def main() -> None:
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request_path, result_path = sys.argv[1:]
    with open(request_path) as file:
        request = json.load(file)
    me = psutil.Process()
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in request["prompts"]]
    sampling = SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True)

    engines, engine_processes = {}, {}
    for row in request["rows"]:
        before = {child.pid for child in me.children(recursive=True)}
        engines[row["name"]] = LLM(
            model=row["path"],
            trust_remote_code=True,
            model_impl=row["model_impl"],
            dtype=request["dtype"],
            enforce_eager=request["enforce_eager"],
            max_model_len=request["max_model_len"],
            max_num_seqs=max(len(prompts), 1),
            seed=0,
        )
        engine_processes[row["name"]] = [me] + [
            child for child in me.children(recursive=True) if child.pid not in before
        ]
    names = list(engines)
    tokens = {}
    for name in names:  # warm-up, and the tokens each row generates (the same prompts for every row)
        outputs = engines[name].generate(prompts, sampling, use_tqdm=False)
        tokens[name] = [list(output.outputs[0].token_ids) for output in outputs]

    rounds = []
    for index in range(request["rounds"]):
        order = names[index % len(names) :] + names[: index % len(names)]
        measured = {}
        for name in order:
            processes = engine_processes[name]
            cpu_before, start = process_tree_cpu_seconds(processes), time.perf_counter()
            outputs = engines[name].generate(prompts, sampling, use_tqdm=False)
            wall = time.perf_counter() - start
            cpu = process_tree_cpu_seconds(processes) - cpu_before
            generated = sum(len(output.outputs[0].token_ids) for output in outputs)
            measured[name] = {"wall_seconds": wall, "cpu_seconds": cpu, "tokens": generated}
        rounds.append({"order": order, **measured})
        print(f"round {index + 1}/{request['rounds']}: " + ", ".join(
            f"{name} {measured[name]['tokens'] / measured[name]['wall_seconds']:.1f} tok/s" for name in names
        ), flush=True)  # fmt: skip

    result = {"rounds": rounds, "tokens": tokens, "load_average": os.getloadavg(), "cpu_count": os.cpu_count()}
    for name in names:
        del engines[name]
    gc.collect()
    partial = f"{result_path}.partial"
    with open(partial, "w") as file:
        json.dump(result, file)
    os.replace(partial, result_path)


if __name__ == "__main__":  # vLLM starts its engines in spawned processes, which import this file again
    main()
