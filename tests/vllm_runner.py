"""Greedy generation with vLLM's offline engine, for tests/test_vllm.py, run in the interpreter that has vLLM
(`DAMCHA_VLLM_PYTHON`, or the test's own): `python tests/vllm_runner.py REQUEST.json RESULT.json`.

REQUEST.json: `{"enforce_eager": bool, "max_tokens": int, "models": {name: {"path": checkpoint, "prompts": [[token
ids], ...]}}}`. RESULT.json: `{name: [[generated token ids], ...]}`, or `{name: {"error": "..."}}` for a model vLLM
would not build. Each model gets its own engine, one after the other, in one process (vLLM's import is the slow part).
Imports only vLLM and the standard library: the plugin need not be installed here (the checkpoints carry their code).
"""

import gc
import json
import os
import sys


def generate(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    results = {}
    for name, job in request["models"].items():
        try:
            llm = LLM(
                model=job["path"],
                trust_remote_code=True,
                model_impl="transformers",
                dtype="float32",
                enforce_eager=request["enforce_eager"],
                max_model_len=256,
                seed=0,
            )
        except Exception as error:  # the engine's refusal is the result the test reads
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in job["prompts"]], sampling)
        results[name] = [list(output.outputs[0].token_ids) for output in outputs]
        del llm
        gc.collect()
    return results


def main() -> None:
    request_path, result_path = sys.argv[1:]
    with open(request_path) as file:
        request = json.load(file)
    results = generate(request)
    partial = f"{result_path}.partial"
    with open(partial, "w") as file:
        json.dump(results, file)
    os.replace(partial, result_path)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file again
    main()
