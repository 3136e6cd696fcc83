"""Code shared by the recipes in this folder: command-line options, model configs, resuming and saving.

Copy this file along with the recipe you copy. Data loading lives in `damcha_hf.data`, metrics in `damcha_hf.metrics`.

Parsing imports only the standard library and the torch-free parts of damcha_hf (torch and transformers come after it), so
`--help` is instant and a bad argument or output folder fails at once, before any data is loaded. Errors end a recipe
with one line on stderr and exit code 2; `--debug` or `DAMCHA_HF_DEBUG=1` shows the traceback (`run_recipe`).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import functools
import glob
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from damcha_hf import argument_checks as checks
from damcha_hf import data_sources, safe_files
from damcha_hf.modeling import damcha_config as options

if TYPE_CHECKING:
    import torch

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
# What a recipe writes directly in --output-dir: Trainer / Accelerate checkpoints, the final model, the results.
RUN_SETTINGS_FILE = "run_settings.json"  # the model settings of a run whose checkpoints do not hold its config
TRACKER_LOGS = "runs"  # TensorBoard's logs with --report-to tensorboard (the Trainer's place; the Accelerate recipe's)
# The results a run writes whole, by these names: an earlier run's are replaced by name.
RUN_RESULT_FILES = ("eval_results.json", "parameter_sha256_rank*.txt", RUN_SETTINGS_FILE)
RUN_FOLDER_ENTRIES = ("checkpoint-*", "final", "adapter", "merged", "base", *RUN_RESULT_FILES, TRACKER_LOGS,
                      safe_files.RUN_RECORD_FILE)  # fmt: skip
RUN_FOLDER_CHECKPOINTS = ("final", "merged", "base")  # replaced as a whole by the final save


def add_metric_arguments(parser: argparse.ArgumentParser) -> None:
    """Every metric option of a DAMCHA config, as `--metric-*` flags (defaults: the config's own)."""
    group = parser.add_argument_group("DAMCHA metric (defaults: the config's)")
    group.add_argument("--metric-context", choices=options.METRIC_CONTEXTS, help="what the cross-head matrix C "
                       "depends on")  # fmt: skip
    group.add_argument("--metric-mask", choices=options.METRIC_MASKS, help="the paper's ablation: full, diagonal, "
                       "offdiagonal")  # fmt: skip
    group.add_argument("--metric-sharing", choices=options.METRIC_SHARINGS, help="one generator per stack or per layer")
    group.add_argument("--metric-hidden-size", type=checks.positive_int, help="hidden width r of the metric generator")
    group.add_argument("--metric-form", choices=options.METRIC_FORMS, help="keys (mixed keys, every backend) or "
                       "scores (sum_j C_ij Q_j K_j^T, eager attention only); see modeling/metric.py")  # fmt: skip
    group.add_argument(
        "--cross-head-variant",
        choices=options.CROSS_HEAD_VARIANTS,
        help="attention variant: damcha, talking_heads, dcmha, or none (plain multi-head attention)",
    )
    group.add_argument(
        "--attn",
        choices=ATTENTION_IMPLEMENTATIONS,
        help="attention implementation (default: sdpa; eager for talking_heads and dcmha, which mix the score maps "
        "that only eager attention materialises)",
    )


METRIC_FIELDS = (
    "metric_context", "metric_mask", "metric_sharing", "metric_hidden_size", "metric_form", "cross_head_variant",
)  # fmt: skip


def resolve_attention(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--attn: sdpa by default, eager for a score-mixing --cross-head-variant or --metric-form scores, which refuse
    any other backend."""
    variant = getattr(args, "cross_head_variant", None)
    mixing = variant in options.SCORE_MIXING_VARIANT_NAMES or getattr(args, "metric_form", None) == "scores"
    if args.attn is None:
        args.attn = "eager" if mixing else "sdpa"
    elif mixing and args.attn != "eager":
        chosen = (
            f"--cross-head-variant {variant}"
            if variant in options.SCORE_MIXING_VARIANT_NAMES
            else "--metric-form scores"
        )
        parser.error(f"{chosen} mixes the attention score maps, which only eager attention materialises; use "
                     f"--attn eager (its default) instead of --attn {args.attn}")  # fmt: skip


def metric_options(args: argparse.Namespace) -> dict:
    """The metric fields set on the command line, as config keyword arguments."""
    return {field: getattr(args, field) for field in METRIC_FIELDS if getattr(args, field, None) is not None}


def add_training_arguments(
    parser: argparse.ArgumentParser,
    *,
    output_dir: str,
    batch_size: int,
    learning_rate: float,
    max_steps: int,
    max_eval_samples: int = 256,
    output_dir_example: str = "runs/damcha_gpt2-stdlib-byte",
) -> None:
    """The shared training flags. `output_dir` names the default run folder and may hold `{settings}`, filled in
    from the run's settings by `parse_checked(..., run_name=...)`, so runs with other settings never share a folder;
    `output_dir_example` is the folder the recipe's defaults give, shown in the help."""
    group = parser.add_argument_group("training")
    group.add_argument(
        "--output-dir",
        default=None,
        help=f"checkpoints and the final model (default: {output_dir.replace('{settings}', 'SETTINGS')}, named after "
        f"the run's settings, e.g. {output_dir_example}): a new or "
        "empty folder; an earlier run's folder needs --overwrite-output-dir (or --resume); a folder holding other "
        "files is refused",
    )
    parser.set_defaults(output_dir_pattern=output_dir)
    group.add_argument("--overwrite-output-dir", action="store_true",
                       help="replace the earlier run of this recipe in --output-dir: its checkpoints, results and "
                       "logs are removed before any data is read, as far as the program's records say it wrote them; "
                       "files of other programs are refused")  # fmt: skip
    group.add_argument("--max-steps", type=checks.positive_int, default=max_steps, help="optimizer steps")
    group.add_argument("--max-train-samples", type=checks.positive_int,
                       help="use only this many training examples (blocks/images)")  # fmt: skip
    group.add_argument("--max-eval-samples", type=checks.positive_int, default=max_eval_samples,
                       help="evaluate on at most this many blocks/images (a run under 100 steps: at most 64 "
                       "unless given)")  # fmt: skip
    group.add_argument("--batch-size", type=checks.positive_int, default=batch_size, help="per device")
    group.add_argument("--gradient-accumulation-steps", type=checks.positive_int, default=1)
    group.add_argument("--learning-rate", type=checks.positive_float, default=learning_rate, help="peak")
    group.add_argument("--weight-decay", type=checks.non_negative_float, default=0.01)
    group.add_argument("--warmup-steps", type=checks.non_negative_int, default=None,
                       help="linear warm-up (default: 5%% of max steps)")  # fmt: skip
    group.add_argument("--logging-steps", type=checks.positive_int, default=10)
    group.add_argument("--eval-steps", type=checks.positive_int, default=None,
                       help=f"evaluate every N steps (default: 4 times a run; a run under {QUICK_RUN_STEPS} steps "
                       "evaluates once, at the end)")  # fmt: skip
    group.add_argument("--save-steps", type=checks.positive_int, default=None,
                       help="checkpoint every N steps (default: = eval steps; at the end for a quick run)")  # fmt: skip
    group.add_argument("--save-total-limit", type=checks.positive_int, default=2,
                       help="keep at most this many checkpoints")  # fmt: skip
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    group.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        help="resume from a checkpoint folder, or (bare `--resume`) from the latest checkpoint of the run in "
        "--output-dir (never one of an earlier run replaced with --overwrite-output-dir). The "
        "model settings saved with the checkpoint win: a model flag (size, --metric-*, --cross-head-variant) left "
        "out takes the checkpoint's value, and one given with a different value is refused, naming every such flag",
    )
    group.add_argument("--resume-weights-only", action="store_true",
                       help="with --resume: continue from the checkpoint's weights and step alone, with a new optimizer "
                       "and learning-rate schedule (warming up again) and new random state; without it, a checkpoint "
                       "whose optimizer, schedule or random state is missing or damaged is refused")  # fmt: skip
    group.add_argument("--num-threads", type=checks.positive_int, help="torch CPU threads (default: torch's choice)")
    group.add_argument("--report-to", default="none", type=report_targets,
                       help="experiment trackers, as transformers' `report_to`: none, all, or a comma-separated "
                       "list (tensorboard, wandb, trackio, ...); each must be installed, checked before any data is "
                       "loaded. TensorBoard logs go to <output-dir>/runs")  # fmt: skip
    group.add_argument("--push-to-hub", action="store_true",
                       help="upload the final model to the Hub with damcha_hf.hub.push_checkpoint (weights, config, "
                       "code, tokenizer/processor, card, images; never the optimizer or trainer state); needs a "
                       "token (HF_TOKEN or `hf auth login`), checked before training")  # fmt: skip
    group.add_argument("--hub-model-id", help="the Hub repository for --push-to-hub (default: the --output-dir name)")
    group.add_argument("--hub-private-repo", action="store_true", help="create the --push-to-hub repository private")
    group.add_argument("--debug", action="store_true", help="on an error, show the traceback, not one line")


def report_targets(text: str) -> list[str]:
    """`--report-to`: "none" (nothing, as []), "all", or comma-separated tracker names, as a list."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or ("none" in names and len(names) > 1) or ("all" in names and len(names) > 1):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 'none', 'all', or tracker names separated by commas (e.g. tensorboard,wandb)"
        )
    return [] if names == ["none"] else names


def check_report_to(args: argparse.Namespace, *, accelerate: bool = False) -> None:
    """--report-to names trackers that transformers' Trainer (or Accelerate, for the Accelerate recipe) knows and that
    are installed here: checked before any data is loaded, since the Trainer would fail only once it is built, and
    Accelerate would silently log nowhere."""
    names = [name for name in args.report_to if name != "all"]
    if not names:
        return
    if accelerate:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
        from accelerate.utils import LoggerType

        known = set(LOGGER_TYPE_TO_CLASS)
        # Accelerate's own trackers are available when their package is; one registered by the user always is.
        available = {str(tracker) for tracker in get_available_trackers()} | (known - set(LoggerType.list()))
        library = "Accelerate"
    else:
        from transformers.integrations import integration_utils

        known = set(integration_utils.INTEGRATION_TO_CALLBACK)
        available = set(integration_utils.get_available_reporting_integrations())
        library = "transformers"
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--report-to {','.join(unknown)}: not a tracker {library} knows; use none, all, or some of "
                         f"{', '.join(sorted(known))}")  # fmt: skip
    missing = [name for name in names if name not in available]
    if missing:
        raise ValueError(f"--report-to {','.join(missing)}: {' and '.join(missing)} not installed here; install it "
                         f"(e.g. `pip install {' '.join(name.replace('_', '-') for name in missing)}`), or leave it "
                         "out of --report-to")  # fmt: skip


# A run with fewer steps is a smoke test: one evaluation (of at most QUICK_RUN_EVAL_SAMPLES, unless
# --max-eval-samples is given) and one checkpoint, at the end.
QUICK_RUN_STEPS = 100
QUICK_RUN_EVAL_SAMPLES = 64


def run_folder_name(*parts) -> str:
    """A folder name from the settings that distinguish a run (`damcha_gpt2-stdlib-byte`): a local path counts by
    its base name, and characters other than letters, digits, `.`, `_` and `-` become `_`."""
    names = []
    for part in parts:
        if part is None or part == "":
            continue
        text = str(part)
        if os.sep in text or os.path.exists(text):
            text = os.path.splitext(os.path.basename(os.path.normpath(text)))[0] or "data"
        names.append("".join(char if char.isalnum() or char in "._-" else "_" for char in text))
    return "-".join(names)


def parse_checked(parser: argparse.ArgumentParser, argv=None, *, run_name=None) -> argparse.Namespace:
    """`parser.parse_args`, then the checks that need several arguments or the disk, as argparse errors (one line,
    exit code 2): the default --output-dir is named after the settings (`run_name(args)`), --output-dir may be
    written (`safe_files.check_run_folder`; an earlier run's folder only with --overwrite-output-dir or --resume),
    and `args.explicit` records the flags given on the command line (for `check_resume_settings`)."""
    args = parser.parse_args(argv)
    args.explicit = explicit_destinations(parser, argv)
    if hasattr(args, "attn"):
        resolve_attention(parser, args)
    if args.max_steps < QUICK_RUN_STEPS and "max_eval_samples" not in args.explicit:
        args.max_eval_samples = min(args.max_eval_samples, QUICK_RUN_EVAL_SAMPLES)  # a smoke test: a small check
    if args.output_dir is None:
        args.output_dir = args.output_dir_pattern.format(settings=run_name(args) if run_name else "run")
    if getattr(args, "resume", None) not in (None, "latest") and not os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume}: no such checkpoint folder")
    if args.resume_weights_only and not args.resume:
        parser.error("--resume-weights-only applies to --resume; add --resume, or leave it out to start a new run")
    hold_run_folder(parser, args.output_dir)
    check_run_folder_contents(parser, args)
    if args.push_to_hub:
        offline = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                   if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")]  # fmt: skip
        if offline:
            parser.error(f"--push-to-hub: the Hub is in offline mode ({offline[0]}=1); unset it on a machine with "
                         "network access, or train without --push-to-hub and run `damcha-hf push` later")  # fmt: skip
        given = args.hub_model_id is not None
        args.hub_model_id = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
        message = checks.repo_id_error(args.hub_model_id)
        if message:  # found now, not after training
            parser.error(f"--hub-model-id {message}" + ("" if given else " (the --output-dir name, its default)")
                         + "; pass --hub-model-id your-name/model-name")  # fmt: skip
    return args


# The --output-dir locks of the recipe runs in progress in this process, one list per `holding_run_folder` call.
_run_locks: list[list] = []


def holding_run_folder(main):
    """Decorate a recipe's `main(argv)`: a run. Its parsing (`parse_checked`) locks --output-dir for it; the lock
    is released when `main` returns or fails, so a run that fails leaves no lock file, nor a folder made for it.
    Parsing outside a run (e.g. `parse_args` alone) only checks that no other run holds the folder."""

    @functools.wraps(main)
    def run(argv=None):
        locks = []
        _run_locks.append(locks)
        try:
            return main(argv)
        finally:
            _run_locks.remove(locks)
            for lock in locks:
                lock.release()

    return run


def hold_run_folder(parser: argparse.ArgumentParser, output_dir: str) -> None:
    """One run per --output-dir: check the path (not a file, the current folder or its parents; creatable), refuse
    it while another run holds it (naming that run's process id) and, in a run (`holding_run_folder`), lock it
    (`safe_files.hold_lock`) and finish what a killed save left in it. Under a multi-process launch only the first
    process does so; the others run under its lock."""
    checks.check_output(parser, safe_files.check_run_folder, output_dir, argument="--output-dir",
                        written=RUN_FOLDER_ENTRIES + LEFTOVER_ENTRIES, checkpoints=())  # fmt: skip
    if os.environ.get("RANK", "0") != "0":  # a later process of a launch: its first process holds the folder
        return
    lock_file = os.path.join(output_dir, safe_files.RUN_LOCK_FILE)
    if not _run_locks:
        holder = safe_files.lock_holder(lock_file)
        if holder is not None:
            parser.error(f"--output-dir {output_dir} is in use by another run (process {holder}, which holds "
                         f"{lock_file}); wait for it to finish, or choose another folder")  # fmt: skip
        return
    lock = checks.check_output(parser, safe_files.hold_lock, lock_file, what=f"--output-dir {output_dir}")
    _run_locks[-1].append(lock)
    safe_files.recover_interrupted_saves(os.path.abspath(output_dir), run_folder_entry, held=True)


# What a killed save or removal leaves in the run folder (`safe_files.recover_interrupted_saves` restores or removes
# it).
LEFTOVER_ENTRIES = tuple(
    f".{pattern}.{kind}-[0-9]*-*" for pattern in RUN_FOLDER_ENTRIES for kind in safe_files.LEFTOVER_KINDS
)


def run_folder_entry(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_FOLDER_ENTRIES)


def check_run_folder_contents(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--output-dir holds only what this recipe writes; an earlier run's only with --overwrite-output-dir (which must
    be able to remove all of it: `safe_files.earlier_run_entries`) or --resume (of that run: a checkpoint from
    elsewhere may not continue into another run's folder)."""
    checks.check_output(parser, safe_files.check_run_folder, args.output_dir, argument="--output-dir",
                        written=RUN_FOLDER_ENTRIES + LEFTOVER_ENTRIES, checkpoints=RUN_FOLDER_CHECKPOINTS)  # fmt: skip
    resume_here = args.resume == "latest" or (args.resume and in_folder(args.resume, args.output_dir))
    if args.overwrite_output_dir and resume_here:
        named = "--resume" if args.resume == "latest" else f"--resume {args.resume}"
        parser.error(f"{named} continues the run in --output-dir {args.output_dir}, which "
                     "--overwrite-output-dir removes; leave out --overwrite-output-dir to continue that run, or "
                     "--resume to replace it with a new one")  # fmt: skip
    if args.overwrite_output_dir:
        checks.check_output(parser, safe_files.earlier_run_entries, args.output_dir, written=RUN_FOLDER_ENTRIES,
                            files=RUN_RESULT_FILES)  # fmt: skip
        return
    earlier = os.path.isdir(args.output_dir) and any(
        entry.name != safe_files.RUN_LOCK_FILE for entry in os.scandir(args.output_dir)
    )
    if not earlier:
        return
    if not args.resume:
        parser.error(
            f"--output-dir {args.output_dir} holds an earlier run (its checkpoints and results would be replaced); "
            "pass --overwrite-output-dir to replace them, --resume to continue that run, or choose another "
            "--output-dir"
        )
    if not resume_here:
        record = checks.check_output(parser, safe_files.read_run_record, args.output_dir)
        stamp = checks.check_output(parser, safe_files.saved_run_id, args.resume)
        if record is None or record["run_id"] != stamp:
            held = f"run {record['run_id']}" if record else "a run without a run record"
            parser.error(f"--resume {args.resume}: --output-dir {args.output_dir} holds another run ({held}), which "
                         "this one would mix with; pass --overwrite-output-dir to replace it, or choose another "
                         "--output-dir")  # fmt: skip


def in_folder(path: str, folder: str) -> bool:
    """Whether `path` is an entry of `folder` itself (not further down)."""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    return os.path.realpath(parent) == os.path.realpath(folder)


def explicit_destinations(parser: argparse.ArgumentParser, argv=None) -> set[str]:
    """The `dest` of every option given on the command line (not left at its default)."""
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = bare.parse_known_args(argv)
    return set(vars(namespace))


def check_resume_settings(args: argparse.Namespace, resume: str | None, flags: dict[str, str], saved: dict) -> None:
    """On resume, the checkpoint's model settings win: fill in each model flag left out from `saved` (the
    checkpoint's config), and refuse flags given with other values, naming every one.

    `flags`: `{argument dest: config field}`, e.g. `{"n_layer": "n_layer", "metric_context": "metric_context"}`.
    """
    if not resume:
        return
    differing = []
    for dest, field in flags.items():
        if field not in saved:
            continue
        if dest in args.explicit and getattr(args, dest) != saved[field]:
            flag = "--" + dest.replace("_", "-")
            differing.append(f"{flag} {getattr(args, dest)} (the checkpoint has {saved[field]})")
        else:
            setattr(args, dest, saved[field])
    if differing:
        raise ValueError(
            f"--resume {resume}: the checkpoint was trained with other model settings: {'; '.join(differing)}. "
            "Leave these flags out (the checkpoint's values are used), or start a new run in another --output-dir."
        )


def saved_model_config(checkpoint: str) -> dict:
    """The model config saved in a checkpoint folder: its `config.json`, the `model_config` of an Accelerate
    recipe's loop state, or the run's `run_settings.json` beside the checkpoint (the LoRA recipe, whose checkpoints
    hold only the adapter). Empty when none is there."""
    run_settings = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), RUN_SETTINGS_FILE)
    for path, key in (
        (os.path.join(checkpoint, "config.json"), None),
        (os.path.join(checkpoint, "loop_state.json"), "model_config"),
        (run_settings, None),
    ):
        if os.path.isfile(path):
            data = safe_files.read_json_file(path, "a model config")
            data = (data.get(key, {}) if key else data) if isinstance(data, dict) else {}
            if data:
                return data
    return {}


def run_recipe(main) -> None:
    """`sys.exit(main())` for a recipe's `__main__`: its errors become one line on stderr and exit code 2."""
    from damcha_hf import cli

    def run() -> int:
        main()  # returns the results, not an exit code
        return 0

    sys.exit(cli.run_guarded(os.path.basename(sys.argv[0]), run, debug=cli.debug_requested()))


def evaluation_schedule(args: argparse.Namespace) -> tuple[int | None, int]:
    """(evaluate every N steps or None, checkpoint every N steps). Four evaluations a run by default; a quick run
    (under QUICK_RUN_STEPS steps, e.g. `--max-steps 5`) evaluates and saves only at the end, so a smoke test is not
    dominated by evaluation. --eval-steps / --save-steps override."""
    if args.eval_steps:
        eval_steps = args.eval_steps
    elif args.max_steps < QUICK_RUN_STEPS:
        eval_steps = None
    else:
        eval_steps = max(1, args.max_steps // 4)
    return eval_steps, args.save_steps or eval_steps or args.max_steps


def live_progress_bar() -> bool:
    """Whether a training loop shows tqdm's live bar: on a terminal only. Written to a log, a bar redraws ten times a
    second and again after every line printed under it; the logs of every --logging-steps steps stand in for it."""
    return sys.stderr.isatty()


def training_arguments(args: argparse.Namespace, *, seq2seq: bool = False, **overrides):
    """`TrainingArguments` from the shared options (`Seq2SeqTrainingArguments` for `seq2seq`)."""
    import torch
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    eval_steps, save_steps = evaluation_schedule(args)
    kwargs = {
        "output_dir": args.output_dir,
        "max_steps": args.max_steps,
        "per_device_train_batch_size": args.batch_size,
        "per_device_eval_batch_size": args.batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "warmup_steps": args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20),
        "lr_scheduler_type": "cosine",
        "logging_steps": args.logging_steps,
        "disable_tqdm": not live_progress_bar(),
        "eval_strategy": "steps" if eval_steps else "no",  # the recipes evaluate once more after training
        "eval_steps": eval_steps,
        "save_strategy": "steps",
        "save_steps": save_steps,
        # --save-total-limit is the run's (`Run.remove_old_checkpoints`): the Trainer's rotation would delete any
        # checkpoint-* folder, an earlier run's or one put there by hand.
        "save_total_limit": None,
        "seed": args.seed,
        "data_seed": args.seed,
        "bf16": args.bf16,
        "report_to": args.report_to,
        "dataloader_num_workers": 0,
        "use_cpu": not torch.cuda.is_available(),
    }
    kwargs.update(overrides)
    return (Seq2SeqTrainingArguments if seq2seq else TrainingArguments)(**kwargs)


def check_push(args: argparse.Namespace, *, accelerate: bool = False) -> None:
    """Before any data is loaded: --report-to's trackers are installed (`check_report_to`) and, with --push-to-hub,
    a token is at hand (`damcha_hf.hub.check_can_push`)."""
    check_report_to(args, accelerate=accelerate)
    if args.push_to_hub:
        from damcha_hf.hub import check_can_push

        check_can_push(None)


def push_final_model(args: argparse.Namespace, folder: str) -> None:
    """--push-to-hub: upload the saved final checkpoint through the plugin's safe push (only the checkpoint's own
    files; never optimizer or trainer state)."""
    if args.push_to_hub:
        from damcha_hf.hub import push_checkpoint

        url = push_checkpoint(folder, args.hub_model_id, private=args.hub_private_repo)
        print(f"pushed {folder} to {args.hub_model_id}: {url}")


TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: what a complete Trainer checkpoint holds


def run_checkpoints(output_dir: str, marker: str) -> list[tuple[int, str]]:
    """The `checkpoint-N` folders in `output_dir` holding `marker`, as (N, path), the largest N first."""
    found = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            prefix, _, number = name.partition("-")
            path = os.path.join(output_dir, name)
            if prefix == "checkpoint" and number.isdigit() and os.path.isfile(os.path.join(path, marker)):
                found.append((int(number), path))
    return sorted(found, reverse=True)


def not_of_run(checkpoint: str, record: dict) -> str | None:
    """Why `checkpoint`, in the folder whose run record is `record`, is not a complete save of that run (None if it
    is): a save cut short, another run's checkpoint, or one no run of the folder saved."""
    stamp = safe_files.saved_run_id(checkpoint)
    if stamp == record["run_id"]:
        return None
    if stamp is not None:
        return f"of another run ({stamp})"
    if os.path.basename(os.path.normpath(checkpoint)) in record["entries"]:
        return "its save was cut short"
    return "no run of this folder saved it (no record of its files)"


def resolve_resume(resume: str | None, output_dir: str, marker: str = TRAINER_STATE_FILE) -> str | None:
    """`--resume` -> a checkpoint folder (or None) of the run in `output_dir`. `latest` picks, like transformers'
    `get_last_checkpoint`, the `checkpoint-N` with the largest N, but only one holding `marker` that the folder's run
    saved in full (its save record carries the run's id, `safe_files.RUN_RECORD_FILE`), saying in one line which it
    skipped; in a folder without a run record (of an older damcha-hf, or a checkpoint copied in) any complete one. A
    checkpoint named in `output_dir` itself must be one of that run's too."""
    if resume is None:
        return None
    record = safe_files.read_run_record(output_dir) if os.path.isdir(output_dir) else None
    if resume == "latest":
        skipped = []
        for _, checkpoint in run_checkpoints(output_dir, marker):
            reason = not_of_run(checkpoint, record) if record else None
            if reason is None:
                if skipped:
                    print(f"--resume: continuing {checkpoint}, the latest checkpoint of run {record['run_id']}; "
                          f"skipped {'; '.join(skipped)}", file=sys.stderr, flush=True)  # fmt: skip
                return checkpoint
            skipped.append(f"{os.path.basename(checkpoint)} ({reason})")
        run = f" of its run ({record['run_id']}; skipped {'; '.join(skipped)})" if skipped else ""
        raise FileNotFoundError(
            f"--resume: no complete checkpoint-N folder{run} in --output-dir {output_dir!r}; train without --resume "
            "first, or pass the checkpoint folder."
        )
    if not os.path.isfile(os.path.join(resume, marker)):
        raise FileNotFoundError(
            f"--resume {resume!r} is not a checkpoint of this recipe (no {marker}); pass a checkpoint-N folder."
        )
    unrecorded = safe_files.saved_files(resume) is None and os.path.basename(os.path.normpath(resume)) not in (
        record["entries"] if record else ()
    )  # a checkpoint of an older damcha-hf, or copied in by hand: named, so the user's choice
    if record and in_folder(resume, output_dir) and not unrecorded:
        reason = not_of_run(resume, record)
        if reason is not None:
            raise ValueError(
                f"--resume {resume}: not a checkpoint of the run in --output-dir {output_dir} (run "
                f"{record['run_id']}): {reason}; pass --resume alone for that run's latest checkpoint, or move "
                f"{resume} out of {output_dir} to continue it in a folder of its own"
            )
    return resume


# What a checkpoint of a `Trainer` recipe holds besides its weights (file pattern: what it is).
TRAINER_RESUME_STATE = {"optimizer.pt": "optimizer state", "scheduler.pt": "learning-rate schedule",
                        "rng_state*.pth": "random number generator state"}  # fmt: skip


def checkpoint_step(checkpoint: str, marker: str = TRAINER_STATE_FILE) -> int | None:
    """The optimizer step a checkpoint was saved at: the Trainer's `global_step`, the Accelerate recipe's `step`."""
    state = safe_files.read_json_file(os.path.join(checkpoint, marker), "the training state")
    step = state.get("global_step", state.get("step")) if isinstance(state, dict) else None
    return step if isinstance(step, int) else None


def check_resume_state(args: argparse.Namespace, checkpoint: str | None, state: dict[str, str],
                       marker: str = TRAINER_STATE_FILE) -> bool:  # fmt: skip
    """Before training: the checkpoint's weights and `marker` are readable, and so is each `state` file, unless
    --resume-weights-only. A missing or damaged one is refused, naming it. A checkpoint past --max-steps is refused
    (training never goes back); one at --max-steps is evaluated and saved as it is, said in one line. Returns whether
    to load the state (False with --resume-weights-only: the weights and the step count alone)."""
    if not checkpoint:
        return False
    safe_files.check_checkpoint_files(checkpoint)
    step = checkpoint_step(checkpoint, marker)
    problems = []
    for pattern, what in {} if args.resume_weights_only else state.items():
        found = sorted(glob.glob(os.path.join(glob.escape(checkpoint), pattern)))
        if not found:
            problems.append(f"{os.path.join(checkpoint, pattern)} ({what}) is missing")
        for path in found:
            try:
                safe_files.check_pickled_archive(path, what)
            except safe_files.CorruptFileError as error:
                problems.append(str(error))
    if problems:
        raise ValueError(
            f"--resume {checkpoint}: {'; '.join(problems)}, so the run cannot continue where it stopped; pass "
            "--resume-weights-only to continue from the weights alone (a new optimizer; the learning rate warms up "
            "again), or resume from another checkpoint"
        )
    if step is not None and step > args.max_steps:
        raise ValueError(
            f"--resume {checkpoint}: the checkpoint is at step {step}, past --max-steps {args.max_steps}, and a run "
            f"never goes back; pass --max-steps {step} to evaluate and save it as it is, a larger --max-steps to train "
            "on, or --overwrite-output-dir instead of --resume to start a new run"
        )
    if step == args.max_steps:
        print(f"--resume {checkpoint}: the checkpoint is at step {step} = --max-steps, so nothing is left to train; "
              "the run evaluates and saves it as it is (a larger --max-steps trains on)", flush=True)  # fmt: skip
    if args.resume_weights_only:
        print(f"--resume-weights-only: continuing from the weights of {checkpoint} at its step, with a new optimizer, "
              "learning-rate schedule and random state")  # fmt: skip
        return False
    return True


def resume_weights_only(trainer) -> None:
    """--resume-weights-only under the `Trainer`: `train(resume_from_checkpoint=...)` then restores the weights and
    the step count, not the optimizer, schedule or random state."""
    trainer._load_optimizer_and_scheduler = lambda checkpoint: None
    trainer._load_rng_state = lambda checkpoint: None


def trainer_resume(args: argparse.Namespace) -> tuple[str | None, bool]:
    """--resume of a `Trainer` recipe, checked before any data is read: the checkpoint folder (or None) and whether
    its optimizer, schedule and random state load (`check_resume_state`)."""
    resume = resolve_resume(args.resume, args.output_dir)
    return resume, check_resume_state(args, resume, TRAINER_RESUME_STATE)


class Run:
    """The training run a recipe makes in --output-dir (`start_run`). Its id is stamped into the save record of every
    checkpoint it saves, and each folder it writes in place is named in the folder's run record before it is written
    (`safe_files.record_run_entry`): so --resume continues only this run's checkpoints, and --overwrite-output-dir
    later removes only what the run wrote. Only the first process of a launch (`main`) writes the records."""

    def __init__(self, output_dir: str, run_id: str, *, resume: str | None, keep: int | None, main: bool = True):
        self.output_dir, self.run_id, self.resume, self.keep, self.main = output_dir, run_id, resume, keep, main

    def writing(self, folder: str) -> None:
        """Before the run writes `folder` (an entry of --output-dir) in place: name it in the run record."""
        if self.main:
            safe_files.record_run_entry(self.output_dir, self.run_id, os.path.basename(os.path.normpath(folder)))

    def wrote(self, folder: str) -> None:
        """Once `folder` is written: record its files with the run's id and, for a checkpoint, keep only the newest
        --save-total-limit of the run's checkpoints (`remove_old_checkpoints`)."""
        if not self.main:
            return
        safe_files.write_save_record(folder, run_id=self.run_id)
        if self.keep and os.path.basename(os.path.normpath(folder)).startswith("checkpoint-"):
            self.remove_old_checkpoints(folder)

    def remove_old_checkpoints(self, newest: str) -> None:
        """--save-total-limit: delete the oldest of this run's checkpoints beyond the newest `keep` (never `newest`,
        the one just saved), each only if it holds nothing but what its save recorded. Unlike the Trainer's own
        rotation, which deletes any `checkpoint-*` folder, another run's checkpoints and a user's are never touched."""
        own = []
        for _, checkpoint in run_checkpoints(self.output_dir, safe_files.SAVE_RECORD_FILE):
            try:
                if safe_files.saved_run_id(checkpoint) == self.run_id:
                    own.append(checkpoint)
            except safe_files.CorruptFileError:
                continue
        older = [checkpoint for checkpoint in own if not os.path.samefile(checkpoint, newest)]
        for checkpoint in older[max(0, self.keep - 1) :]:
            foreign = safe_files.foreign_entries(Path(checkpoint))
            if foreign:
                print(f"--save-total-limit: keeping {checkpoint}, which holds files its save did not write "
                      f"({', '.join(foreign[:5])})", file=sys.stderr, flush=True)  # fmt: skip
                continue
            safe_files.remove_entries([checkpoint])

    def trainer_callback(self, trainer):
        """A `TrainerCallback` that records each checkpoint the `trainer` saves: named before the save, its files and
        the run's id after (every process has then written its part, e.g. its random state)."""
        from transformers import TrainerCallback

        run = self

        class RunRecord(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if control.should_save and state.is_world_process_zero:
                    run.writing(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

            on_epoch_end = on_step_end

            def on_save(self, args, state, control, **kwargs):
                trainer.accelerator.wait_for_everyone()
                if state.is_world_process_zero:
                    run.wrote(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

        return RunRecord()


def start_run(args: argparse.Namespace, resume: str | None) -> Run:
    """Start the run in --output-dir, after every check and before any data is read: with --overwrite-output-dir the
    earlier run goes, as far as its records say it wrote it (`safe_files.earlier_run_entries`, checked again; each
    entry renamed aside, then deleted, so that a kill leaves nothing half-removed), said in one line. A resumed run
    keeps its id (its checkpoint's, else the folder's) and drops the saves it left unfinished; a new run gets a new
    id. Under a multi-process launch only the first process touches the folder."""
    main = os.environ.get("RANK", "0") == "0"
    output_dir = args.output_dir
    if main and args.overwrite_output_dir:
        entries = safe_files.earlier_run_entries(output_dir, written=RUN_FOLDER_ENTRIES, files=RUN_RESULT_FILES)
        if entries:
            removed = safe_files.remove_entries(entries)
            shown = [name for name in removed if name != safe_files.RUN_RECORD_FILE]
            print(f"--overwrite-output-dir: removed the earlier run in {output_dir} ({', '.join(shown) or 'its record'})",
                  flush=True)  # fmt: skip
    record = safe_files.read_run_record(output_dir) if os.path.isdir(output_dir) else None
    run_id = None
    if resume:
        run_id = safe_files.saved_run_id(resume) or (record["run_id"] if record else None)
    run = Run(output_dir, run_id or safe_files.new_run_id(), resume=resume, keep=args.save_total_limit, main=main)
    if main and record and record["run_id"] == run.run_id:
        unfinished = [
            os.path.join(output_dir, name)
            for name in record["entries"]
            if name.startswith("checkpoint-")
            and os.path.isdir(os.path.join(output_dir, name))
            and not os.path.islink(os.path.join(output_dir, name))
            and safe_files.saved_files(os.path.join(output_dir, name)) is None
        ]
        if unfinished:
            removed = safe_files.remove_entries(unfinished)
            print(f"{output_dir}: removed {', '.join(removed)}, left unfinished by an interrupted save", flush=True)
    if main and args.report_to:
        run.writing(os.path.join(output_dir, TRACKER_LOGS))  # TensorBoard's logs, written all along the run
    return run


def train(trainer, run: Run, load_state: bool):
    """`trainer.train()`, recording the run's checkpoints (`Run.trainer_callback`), from `run.resume` when given: its
    whole state, or (`load_state` False) its weights and step. A checkpoint already at `max_steps` is loaded, not
    trained on (the Trainer would take one more step): the training loss of this call is then None."""
    trainer.add_callback(run.trainer_callback(trainer))
    resume = run.resume
    if resume and (checkpoint_step(resume) or 0) >= trainer.args.max_steps:
        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import TrainOutput

        trainer._load_from_checkpoint(resume)
        trainer.state = TrainerState.load_from_json(os.path.join(resume, TRAINER_STATE_FILE))
        return TrainOutput(trainer.state.global_step, None, {})
    if resume and not load_state:
        resume_weights_only(trainer)
    return trainer.train(resume_from_checkpoint=resume)


def load_resumed_weights(auto_class, resume: str, attn: str):
    """The model of the `resume` checkpoint, loaded by `from_pretrained`. transformers 5.24 saves ViT weights under the
    legacy key names (vit.encoder.layer.N.attention.attention.*) and the Trainer's resume reads them back without
    renaming, leaving the encoder at its fresh init (plain ViT models too); from_pretrained applies the renames, and
    the Trainer then restores optimizer, scheduler, random state and data position."""
    with safe_files.loading_checkpoint(resume, "the --resume checkpoint"):
        return auto_class.from_pretrained(resume, attn_implementation=attn)


def print_evaluation(metrics: dict) -> None:
    """The evaluation figures and the step reached, on one line of the run's output."""
    print({key: value for key, value in metrics.items() if key.startswith("eval_") or key == "global_step"})


def finish_run(args: argparse.Namespace, final: str, metrics: dict, saved_note: str = "") -> None:
    """After the final save: `<output-dir>/eval_results.json`, and the push of `final` with --push-to-hub."""
    write_json(os.path.join(args.output_dir, "eval_results.json"), metrics)
    print(f"saved to {final}{saved_note}")
    push_final_model(args, final)


def check_resume_tokenizer(args: argparse.Namespace, resume: str) -> None:
    """On resume the checkpoint's tokenizer is used; a --tokenizer given with another one is refused like other
    conflicting flags. `byte` is the tokenizer without merges, `bpe` one with merges, a folder its own tokenizer."""
    if "tokenizer" not in args.explicit or os.path.abspath(args.tokenizer) == os.path.abspath(resume):
        return
    path = os.path.join(resume, "tokenizer.json")
    saved = safe_files.read_json_file(path, "a tokenizer")
    merges = bool((saved.get("model") or {}).get("merges")) if isinstance(saved, dict) else False
    if args.tokenizer in ("byte", "bpe"):
        matches = merges == (args.tokenizer == "bpe")
        saved_kind = "a BPE tokenizer (with merges)" if merges else "the byte-level tokenizer"
    else:
        given = os.path.join(args.tokenizer, "tokenizer.json")
        matches = os.path.isfile(given) and safe_files.read_json_file(given, "a tokenizer") == saved
        saved_kind = "another tokenizer"
    if not matches:
        raise ValueError(
            f"--resume {resume}: the checkpoint was trained with {saved_kind}, not --tokenizer {args.tokenizer}. "
            "Leave --tokenizer out (the checkpoint's is used), or start a new run in another --output-dir."
        )


# `--model-type`: the `model_type` of a new model; "damcha" is DAMCHA GPT-2 (the default, kept for older commands).
LANGUAGE_MODEL_TYPES = ("damcha", "damcha_gpt2", "gpt2", "damcha_llama", "llama")


def gpt2_config(args: argparse.Namespace, vocab_size: int, tokenizer=None):
    """A new language-model config from the size and metric options: DAMCHA GPT-2 (default), plain GPT-2
    (`--model-type gpt2`), DAMCHA Llama (`--model-type damcha_llama`, grouped-query with `--n-kv-head`) or plain
    Llama (`--model-type llama`)."""
    from transformers import GPT2Config, LlamaConfig

    import damcha_hf

    model_type = getattr(args, "model_type", "damcha")
    special_tokens = {}
    if tokenizer is not None:
        special_tokens = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                          "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    if model_type in ("llama", "damcha_llama"):
        sizes = {
            "vocab_size": vocab_size,
            "max_position_embeddings": args.block_size,
            "hidden_size": args.n_embd,
            "num_hidden_layers": args.n_layer,
            "num_attention_heads": args.n_head,
            "num_key_value_heads": getattr(args, "n_kv_head", None) or args.n_head,
            # SwiGLU has three matrices: 8/3 of the width (rounded up to a multiple of 32) matches GPT-2's 4x MLP size
            "intermediate_size": -(-8 * args.n_embd // 3 // 32) * 32,
            "attention_dropout": args.dropout,
            **special_tokens,
        }
        plain, damcha = LlamaConfig, damcha_hf.DamchaLlamaConfig
    else:
        sizes = {
            "vocab_size": vocab_size,
            "n_positions": args.block_size,
            "n_embd": args.n_embd,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "resid_pdrop": args.dropout,
            "embd_pdrop": args.dropout,
            "attn_pdrop": args.dropout,
            **special_tokens,
        }
        plain, damcha = GPT2Config, damcha_hf.DamchaGPT2Config
    config = plain(**sizes) if model_type in ("gpt2", "llama") else damcha(**sizes, **metric_options(args))
    config._attn_implementation = args.attn
    return config


def language_model_run_name(args: argparse.Namespace) -> str:
    """The default run folder of a language-model recipe: model type, variant and metric context when given, data,
    tokenizer (e.g. `damcha_gpt2-stdlib-byte`, `damcha_gpt2-gcide-bpe`)."""
    model_type = {"damcha": "damcha_gpt2"}.get(args.model_type, args.model_type)
    return run_folder_name(model_type, args.cross_head_variant, args.metric_context, args.data, args.tokenizer)


def use_causal_lm_loss(model):
    """Name the model's loss explicitly: transformers picks it from the class name, finds none in `...LMHeadModel`
    (stock GPT-2 too), warns "`loss_type=None` was set in the config but it is unrecognized" and uses the causal-LM
    loss anyway. Returns `model`."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def add_gpt2_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (new models)")
    group.add_argument("--model-type", choices=LANGUAGE_MODEL_TYPES, default="damcha",
                       help="damcha / damcha_gpt2 (DAMCHA GPT-2, default), gpt2 (plain GPT-2, the baseline), "
                       "damcha_llama (DAMCHA Llama: RoPE, RMSNorm, SwiGLU, grouped-query with --n-kv-head) or llama "
                       "(plain Llama)")  # fmt: skip
    group.add_argument("--n-layer", type=checks.positive_int, default=4)
    group.add_argument("--n-embd", type=checks.positive_int, default=128)
    group.add_argument("--n-head", type=checks.positive_int, default=8, help="must divide --n-embd (default: 8)")
    group.add_argument("--n-kv-head", type=checks.positive_int,
                       help="Llama: key/value heads, dividing --n-head (grouped-query; default: --n-head)")  # fmt: skip
    group.add_argument("--block-size", type=checks.positive_int, default=128,
                       help="context length in tokens (default: 128)")  # fmt: skip
    group.add_argument("--dropout", type=checks.probability, default=0.0)


# Flags of a new language model and the config fields they set: checked against the checkpoint on --resume.
GPT2_MODEL_FLAGS = {"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head", "block_size": "n_positions",
                    **{field: field for field in METRIC_FIELDS}}  # fmt: skip
LLAMA_MODEL_FLAGS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
                     "n_kv_head": "num_key_value_heads", "block_size": "max_position_embeddings",
                     **{field: field for field in METRIC_FIELDS}}  # fmt: skip


def language_model_flags(saved_config: dict) -> dict[str, str]:
    """The resume flags of a saved language-model config: Llama's field names for a Llama checkpoint, else GPT-2's."""
    return LLAMA_MODEL_FLAGS if saved_config.get("model_type") in ("llama", "damcha_llama") else GPT2_MODEL_FLAGS


def check_language_model_resume(args: argparse.Namespace, resume: str | None) -> None:
    """`check_resume_settings` for the language-model recipes: the checkpoint's architecture (`--model-type`, left out:
    taken from the checkpoint) and its sizes under that architecture's field names (Llama's or GPT-2's) win."""
    if not resume:
        return
    saved = saved_model_config(resume)
    saved_type = saved.get("model_type")
    if saved_type in LANGUAGE_MODEL_TYPES:
        requested = {"damcha": "damcha_gpt2"}.get(args.model_type, args.model_type)
        if "model_type" in args.explicit and requested != saved_type:
            raise ValueError(
                f"--resume {resume}: the checkpoint is a {saved_type} model, not --model-type {args.model_type}. Leave "
                "--model-type out (the checkpoint's is used), or start a new run in another --output-dir."
            )
        args.model_type = saved_type
    check_resume_settings(args, resume, language_model_flags(saved), saved)


def check_new_language_model_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--n-head divides --n-embd; --n-kv-head is Llama's (grouped-query) and divides --n-head."""
    checks.check_heads_divide_width(parser, args.n_embd, args.n_head, width_flag="--n-embd", heads_flag="--n-head")
    if args.n_kv_head is not None:
        if args.model_type not in ("llama", "damcha_llama"):
            parser.error(f"--n-kv-head applies to --model-type llama or damcha_llama (grouped-query attention), not "
                         f"{args.model_type}; leave it out for GPT-2.")  # fmt: skip
        checks.check_heads_divide_width(parser, args.n_head, args.n_kv_head, width_flag="--n-head",
                                        heads_flag="--n-kv-head")  # fmt: skip


def tokenizer_source(text: str) -> str:
    """--tokenizer: 'byte', 'bpe' or a folder holding a saved tokenizer, checked while parsing."""
    if text in ("byte", "bpe") or os.path.isfile(os.path.join(text, "tokenizer_config.json")):
        return text
    found = "is not a folder" if not os.path.isdir(text) else "has no tokenizer_config.json"
    raise argparse.ArgumentTypeError(f"{text!r} {found}; use 'byte', 'bpe' or a folder a tokenizer was saved to")


def add_text_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default="stdlib",
        type=checks.text_data_source,
        help="a text file, folder of .txt files, glob, 'stdlib' (Python's standard library sources; default) or "
        "'gcide' (the GCIDE dictionary)",
    )
    group.add_argument("--file-pattern", default="**/*.txt", help="files to read in a --data folder")
    group.add_argument("--max-data-bytes", type=checks.positive_int, help="read only about this many bytes of text")
    group.add_argument("--validation-fraction", type=checks.probability, default=0.05)
    group.add_argument("--tokenizer", default="byte", type=tokenizer_source,
                       help="'byte' (default; bits per byte = bits per token), 'bpe' (trained here), "
                       "or a saved tokenizer folder")  # fmt: skip
    group.add_argument("--bpe-vocab-size", type=checks.positive_int, default=4096)


def build_tokenizer(args: argparse.Namespace, corpus):
    """The tokenizer of --tokenizer, its `model_max_length` the context (--block-size), which every checkpoint saves."""
    from transformers import AutoTokenizer

    from damcha_hf.data import byte_level_tokenizer, train_bpe_tokenizer

    if args.tokenizer == "byte":
        return byte_level_tokenizer(model_max_length=args.block_size)
    if args.tokenizer == "bpe":
        size = sum(len(text) for text in corpus["train"]["text"])
        print(f"training a byte-level BPE tokenizer ({args.bpe_vocab_size} tokens) on {size / 1e6:.1f} M characters "
              "of training text with `tokenizers`...", flush=True)  # fmt: skip
        return train_bpe_tokenizer(corpus["train"]["text"], args.bpe_vocab_size, model_max_length=args.block_size)
    if os.path.isdir(args.tokenizer):
        return AutoTokenizer.from_pretrained(args.tokenizer, model_max_length=args.block_size)
    raise ValueError(f"--tokenizer {args.tokenizer!r}: use 'byte', 'bpe' or an existing tokenizer folder.")


# Bytes per token assumed when sizing the text a run reads: exact for the byte-level tokenizer, generous for BPE.
BYTES_PER_TOKEN = {"byte": 1}
BPE_BYTES_PER_TOKEN = 4


def data_bytes_needed(args: argparse.Namespace) -> int:
    """About how many bytes of text a run needs: twice the training tokens of --max-steps (or --max-train-samples)
    and twice the validation tokens of --max-eval-samples (the validation split gets --validation-fraction of it),
    so that a quick run does not read and tokenise a whole corpus."""
    bytes_per_token = BYTES_PER_TOKEN.get(args.tokenizer, BPE_BYTES_PER_TOKEN)
    blocks = args.max_steps * args.batch_size * args.gradient_accumulation_steps
    if args.max_train_samples is not None:
        blocks = min(blocks, args.max_train_samples)
    block_bytes = args.block_size * bytes_per_token
    train = 2 * blocks * block_bytes / (1 - args.validation_fraction)
    validation = 2 * args.max_eval_samples * block_bytes / args.validation_fraction if args.validation_fraction else 0
    return int(max(train, validation, 1 << 16))


def load_language_model_corpus(args: argparse.Namespace):
    """The text corpus of a language-model recipe: all of --max-data-bytes when given, else only about what the run
    needs (`data_bytes_needed`), said in one line."""
    from damcha_hf.data import load_text_corpus

    max_bytes = args.max_data_bytes
    if max_bytes is None:
        max_bytes = data_bytes_needed(args)
        print(f"reading about {max_bytes / 1e6:.1f} MB of --data {args.data} (what {args.max_steps} steps and "
              f"{args.max_eval_samples} validation blocks need; --max-data-bytes sets it)", flush=True)  # fmt: skip
    return load_text_corpus(args.data, validation_fraction=args.validation_fraction, seed=args.seed,
                            max_bytes=max_bytes, pattern=args.file_pattern)  # fmt: skip


def language_model_data(args: argparse.Namespace, tokenizer, corpus=None):
    """(train blocks, validation blocks) from the data options. The validation blocks are drawn at random (with
    --seed) from every held-out document; `args.validation_documents` and `args.validation_note` say how many
    documents they cover, for the results and the card."""
    from damcha_hf.data import group_into_blocks, sample_blocks

    if corpus is None:
        corpus = load_language_model_corpus(args)
    # One document per row for folders and 'stdlib'; sections of one text otherwise.
    separate_documents = args.data == "stdlib" or os.path.isdir(str(args.data))
    blocks = group_into_blocks(
        corpus, tokenizer, args.block_size, separate_documents=separate_documents, document_ids=True
    )
    train = blocks["train"].remove_columns("document")
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    validation, args.validation_documents = sample_blocks(blocks["validation"], args.max_eval_samples, seed=args.seed)
    held_out = "documents" if separate_documents else "sections of the text"
    args.validation_note = (f"{len(validation)} blocks of {args.block_size} tokens drawn at random (seed {args.seed}) "
                            f"from {args.validation_documents} held-out {held_out}")  # fmt: skip
    print(f"validation: {args.validation_note}", flush=True)
    return train, validation


def save_final_model(model, folder: str, *, tokenizer_or_processor=None, log_history=None, **card_fields) -> str:
    """Save a Hub-ready checkpoint to `folder` with `damcha_hf.hub.save_hub_checkpoint` (weights, config, code,
    tokenizer or processor, model card, loss curve, metric heatmap), written to a temporary folder and renamed into
    place. An existing `folder` is replaced only when it holds an earlier checkpoint of this plugin."""
    from damcha_hf.hub import save_hub_checkpoint

    save_hub_checkpoint(
        model, folder, tokenizer_or_processor=tokenizer_or_processor, log_history=log_history, overwrite=True,
        **card_fields,
    )  # fmt: skip
    return folder


def write_json(path: str, payload: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    safe_files.write_json(path, payload)


def card_datasets(data: str) -> list[str]:
    """The model card's `datasets:` for a --data value: a local path is named by its base name only, never the
    path (a push would publish it); 'stdlib' and 'gcide' by what they are."""
    public = {"stdlib": "python-stdlib-sources", "gcide": "gcide", "fashion-mnist": "fashion_mnist"}
    if data in public:
        return [public[data]]
    name = safe_files.public_dataset_name(data)
    return [name] if name else []


# ------------------------------------------------------------------------------------------------- image recipes


def add_image_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data", default="fashion-mnist",
                       help="an image folder (<folder>/<label>/<images>) or 'fashion-mnist' (the idx files in "
                       "--fashion-mnist-dir; default)")  # fmt: skip
    group.add_argument("--fashion-mnist-dir", default="/usr/share/datasets/fashion-mnist")
    group.add_argument("--image-size", type=checks.positive_int, default=None, help="resize to this (default: 28 for Fashion-MNIST, "
                       "else 64)")  # fmt: skip
    group.add_argument("--no-augment", action="store_true", help="no random crop / flip of training images")


# The ViT size flags of a new model and the config fields they set (checked against the checkpoint on --resume).
VIT_MODEL_FLAGS = {"patch_size": "patch_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                   "num_heads": "num_attention_heads", **{field: field for field in METRIC_FIELDS}}  # fmt: skip


def add_vit_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The size of a new ViT (classifier or denoiser): patch, width, depth, heads, MLP ratio, dropout."""
    group = parser.add_argument_group("model size (new models)")
    group.add_argument("--patch-size", type=checks.positive_int, default=4)
    group.add_argument("--hidden-size", type=checks.positive_int, default=192)
    group.add_argument("--num-layers", type=checks.positive_int, default=6)
    group.add_argument("--num-heads", type=checks.positive_int, default=6, help="must divide --hidden-size")
    group.add_argument("--mlp-ratio", type=checks.positive_int, default=4)
    group.add_argument("--dropout", type=checks.probability, default=0.0)


def vit_config_options(args: argparse.Namespace, channels: int, image_size: int) -> dict:
    """The ViT config fields of the size and metric flags (`add_vit_size_arguments`, `add_metric_arguments`)."""
    return {
        "image_size": image_size,
        "patch_size": args.patch_size,
        "num_channels": channels,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "intermediate_size": args.mlp_ratio * args.hidden_size,
        "hidden_dropout_prob": args.dropout,
        "attention_probs_dropout_prob": args.dropout,
        **metric_options(args),
    }


def check_causal_metric_context(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A language model is causal: `--metric-context sequence` would let each token see the future."""
    if getattr(args, "metric_context", None) == "sequence":
        parser.error("--metric-context sequence averages over the whole sequence, which would let a causal language "
                     "model see future tokens; use --metric-context token (or query)")  # fmt: skip


def saved_model_type(checkpoint: str) -> str | None:
    """The `model_type` in a checkpoint folder's config.json (read as JSON: no transformers import), or None."""
    try:
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as handle:
            return json.load(handle).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_image_data(parser: argparse.ArgumentParser, data: str) -> None:
    """`--data` of an image recipe is 'fashion-mnist' or an image folder laid out as `load_image_folder` reads it."""
    if data != "fashion-mnist":
        message = data_sources.image_folder_error(data)
        if message:
            parser.error(f"--data {message}, or 'fashion-mnist'")


def image_datasets(args: argparse.Namespace):
    """(DatasetDict with train/validation of `image` + `label`, label names, channels) from the data options."""
    from damcha_hf.data import load_fashion_mnist, load_image_folder

    if args.data == "fashion-mnist":
        train_images = args.max_train_samples
        if train_images is None:  # only what the run needs, as the text recipes read only the text they need
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            train_images = 2 * args.max_steps * args.batch_size * args.gradient_accumulation_steps * world_size
            print(f"reading at most {train_images:,} Fashion-MNIST training images (twice what {args.max_steps} steps "
                  "need; --max-train-samples sets it)", flush=True)  # fmt: skip
        train = load_fashion_mnist(args.fashion_mnist_dir, "train", max_samples=train_images)
        validation = load_fashion_mnist(args.fashion_mnist_dir, "test", max_samples=args.max_eval_samples)
        import datasets

        splits = datasets.DatasetDict(train=train, validation=validation)
        image_size = args.image_size or 28
    else:
        splits = load_image_folder(args.data, seed=args.seed)
        if args.max_train_samples is not None:
            splits["train"] = splits["train"].select(range(min(args.max_train_samples, len(splits["train"]))))
        if args.max_eval_samples is not None:
            splits["validation"] = splits["validation"].select(
                range(min(args.max_eval_samples, len(splits["validation"])))
            )
        image_size = args.image_size or 64
    labels = splits["train"].features["label"].names
    channels = 1 if splits["train"][0]["image"].mode in ("L", "I", "I;16", "F") else 3
    return splits, labels, channels, image_size


def image_processor(image_size: int, channels: int):
    """The ViT image processor: the torchvision backend where torchvision is installed, else the PIL one, by name
    (transformers falls back to it too, with a warning in every run). Both save as `ViTImageProcessor`."""
    import transformers
    from transformers.utils import is_torchvision_available

    # By name: even looking up `ViTImageProcessor` without torchvision gives the warning.
    processor_class = "ViTImageProcessor" if is_torchvision_available() else "ViTImageProcessorPil"
    return getattr(transformers, processor_class)(
        size={"height": image_size, "width": image_size},
        image_mean=[0.5] * channels,
        image_std=[0.5] * channels,
        do_convert_rgb=channels == 3,
    )


def random_crop_and_flip(pixel_values: torch.Tensor, padding: int, generator: torch.Generator | None = None):
    """Light augmentation with torch ops only (no torchvision): reflect-pad by `padding`, crop back to the original
    size at a random offset, and flip left-right with probability 1/2. `pixel_values`: (channels, height, width)."""
    import torch

    _, height, width = pixel_values.shape
    if padding > 0:
        padded = torch.nn.functional.pad(pixel_values[None], (padding,) * 4, mode="reflect")[0]
        top, left = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist()
        pixel_values = padded[:, top : top + height, left : left + width]
    if torch.rand((), generator=generator) < 0.5:
        pixel_values = pixel_values.flip(-1)
    return pixel_values


def attach_image_transforms(splits, processor, *, augment: bool, image_size: int) -> None:
    """Process images on the fly (`set_transform`): `pixel_values` from the processor, augmented for training."""
    padding = max(1, image_size // 8)

    import torch

    def transform(batch, train: bool):
        pixel_values = processor(batch["image"], return_tensors="pt")["pixel_values"]
        if train and augment:
            pixel_values = torch.stack([random_crop_and_flip(p, padding) for p in pixel_values])
        return {"pixel_values": pixel_values, "labels": batch["label"]}

    splits["train"].set_transform(lambda batch: transform(batch, True))
    splits["validation"].set_transform(lambda batch: transform(batch, False))


def image_collate(examples):
    import torch

    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }
