"""Writing files without losing any, and reading checkpoints that may be damaged, one module per job:

    atomic_files        writes that are never left half-done (a temporary name, then a rename) and the lock files
                        that keep one run per output folder and one save at a time per checkpoint folder
    output_folders      the rule that no command deletes or overwrites a file it did not write: output folder checks,
                        the records of what a save and a run wrote, and finishing what a killed save left
    checkpoint_checks   a truncated, garbage or mismatched input checkpoint as one line naming the file and the fault

Their public names are importable from here too. Standard library only, so the command line and the recipes check
their paths while parsing arguments, before torch or transformers are imported.
"""

from .atomic_files import (
    FolderLock,
    UnsafeOutputError,
    atomic_path,
    atomic_write,
    hold_lock,
    lock_holder,
    make_staging_folder,
    save_lock_file,
    wait_for_lock,
    write_json,
)
from .checkpoint_checks import (
    CorruptFileError,
    check_checkpoint_files,
    check_pickled_archive,
    check_safetensors_file,
    loading_checkpoint,
    read_json_file,
    reading,
    weight_files,
)
from .output_folders import (
    LEFTOVER_KINDS,
    METRIC_HEATMAP_FILE,
    MODEL_TYPE_PREFIX,
    PNG_SOFTWARE,
    RUN_LOCK_FILE,
    RUN_RECORD_FILE,
    SAVE_RECORD_FILE,
    apply_umask,
    check_checkpoint_folder,
    check_checkpoint_location,
    check_run_folder,
    check_writable_location,
    earlier_run_entries,
    foreign_entries,
    new_run_id,
    png_text,
    read_run_record,
    record_run_entry,
    recover_interrupted_saves,
    remove_entries,
    saved_files,
    saved_run_id,
    write_save_record,
)

__all__ = [
    "LEFTOVER_KINDS",
    "METRIC_HEATMAP_FILE",
    "MODEL_TYPE_PREFIX",
    "PNG_SOFTWARE",
    "RUN_LOCK_FILE",
    "RUN_RECORD_FILE",
    "SAVE_RECORD_FILE",
    "CorruptFileError",
    "FolderLock",
    "UnsafeOutputError",
    "apply_umask",
    "atomic_path",
    "atomic_write",
    "check_checkpoint_files",
    "check_checkpoint_folder",
    "check_checkpoint_location",
    "check_pickled_archive",
    "check_run_folder",
    "check_safetensors_file",
    "check_writable_location",
    "earlier_run_entries",
    "foreign_entries",
    "hold_lock",
    "loading_checkpoint",
    "lock_holder",
    "make_staging_folder",
    "new_run_id",
    "png_text",
    "read_json_file",
    "read_run_record",
    "reading",
    "record_run_entry",
    "recover_interrupted_saves",
    "remove_entries",
    "save_lock_file",
    "saved_files",
    "saved_run_id",
    "wait_for_lock",
    "weight_files",
    "write_json",
    "write_save_record",
]
