"""lm-evaluation-harness tasks whose data is a local file, for evaluating a DAMCHA checkpoint offline.

    lm_eval --model hf --model_args pretrained=path/to/checkpoint,trust_remote_code=True \\
        --include_path "$(python -m damcha_hf.lm_eval_tasks)" --tasks damcha_local_choice

`damcha_local_choice.yaml` is a multiple-choice task (accuracy from each choice's log-likelihood) over
`local_choice.jsonl`, rows of `{"question": ..., "choices": [...], "answer": <index>}`; `local_data.py` reads that file
from beside the YAML, or the file named by `--metadata '{"data_file": "path/to/yours.jsonl"}'`, so the task runs from any
folder and on your own questions. `python -m damcha_hf.lm_eval_tasks` prints this folder.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
