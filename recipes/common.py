"""The recipe modules' names in one namespace, as `recipes/finetune_lora.py` reads them (`common.parse_checked`, ...).

Nothing is defined here: options live in `recipe_options`, the run folder and resuming in `run_folder`, text data and
language-model configs in `text_data`, image data in `image_data`. Other recipes import those modules directly.
"""

from image_data import attach_image_transforms, check_image_data, image_collate, image_datasets, image_processor
from recipe_options import (
    METRIC_FIELDS,
    add_metric_arguments,
    add_training_arguments,
    check_causal_metric_context,
    check_push,
    metric_options,
    parse_checked,
    run_folder_name,
    run_recipe,
    saved_model_type,
    training_arguments,
)
from run_folder import (
    RUN_SETTINGS_FILE,
    card_datasets,
    check_resume_settings,
    holding_run_folder,
    print_evaluation,
    push_final_model,
    save_final_model,
    saved_model_config,
    start_run,
    train,
    trainer_resume,
)
from text_data import build_tokenizer, language_model_data, load_language_model_corpus, use_causal_lm_loss

from damcha_hf import argument_checks as checks
from damcha_hf import safe_files
from damcha_hf.safe_files.atomic_files import write_json

__all__ = [
    "METRIC_FIELDS", "RUN_SETTINGS_FILE", "add_metric_arguments", "add_training_arguments", "attach_image_transforms",
    "build_tokenizer", "card_datasets", "check_causal_metric_context", "check_image_data", "check_push",
    "check_resume_settings", "checks", "holding_run_folder", "image_collate", "image_datasets", "image_processor",
    "language_model_data", "load_language_model_corpus", "metric_options", "parse_checked", "print_evaluation",
    "push_final_model", "run_folder_name", "run_recipe", "safe_files", "save_final_model", "saved_model_config",
    "saved_model_type", "start_run", "train", "trainer_resume", "training_arguments", "use_causal_lm_loss", "write_json",
]  # fmt: skip
