"""Print the folder of the shipped lm-evaluation-harness tasks, for `lm_eval --include_path`."""

from . import TASKS_DIR

print(TASKS_DIR)
