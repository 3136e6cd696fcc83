"""The dataset of the shipped tasks: a local JSON-lines file, read with `datasets` (lm-eval's `custom_dataset`)."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load_local_choice(data_file: str | None = None, **metadata):
    """`{"test": rows}` of `data_file` (lm-eval's `--metadata '{"data_file": ...}'`), or of local_choice.jsonl beside
    this file. lm-eval passes its other metadata (the task version) too; they are not dataset options."""
    import datasets

    path = data_file or os.path.join(HERE, "local_choice.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data_file {path!r}: no such file; give a JSON-lines file of "
                                '{"question": ..., "choices": [...], "answer": <index>} rows')  # fmt: skip
    return datasets.load_dataset("json", data_files={"test": path})
