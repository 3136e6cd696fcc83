"""The run folder of a recipe (--output-dir): one run at a time (its lock), the run record naming what the run wrote,
--overwrite-output-dir (removing only that), --resume (only the run's own complete checkpoints, checked before any data
is read), training from the resume point, and finishing a run (final save, results, push).
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import glob
import os
import sys
from pathlib import Path

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import atomic_files, checkpoint_checks, output_folders

# What a recipe writes directly in --output-dir: Trainer / Accelerate checkpoints, the final model, the results.
RUN_SETTINGS_FILE = "run_settings.json"  # the model settings of a run whose checkpoints do not hold its config
TRACKER_LOGS = "runs"  # TensorBoard's logs with --report-to tensorboard (the Trainer's place; the Accelerate recipe's)

# The results a run writes whole, by these names: an earlier run's are replaced by name.
RUN_RESULT_FILES = ("eval_results.json", "parameter_sha256_rank*.txt", RUN_SETTINGS_FILE)
RUN_FOLDER_ENTRIES = ("checkpoint-*", "final", "adapter", "merged", "base", *RUN_RESULT_FILES, TRACKER_LOGS,
                      output_folders.RUN_RECORD_FILE)  # fmt: skip
RUN_FOLDER_CHECKPOINTS = ("final", "merged", "base")  # replaced as a whole by the final save

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
    (`atomic_files.hold_lock`) and finish what a killed save left in it. Under a multi-process launch only the first
    process does so; the others run under its lock."""
    checks.check_output(parser, output_folders.check_run_folder, output_dir, argument="--output-dir",
                        written=RUN_FOLDER_ENTRIES + LEFTOVER_ENTRIES, checkpoints=())  # fmt: skip
    if os.environ.get("RANK", "0") != "0":  # a later process of a launch: its first process holds the folder
        return
    lock_file = os.path.join(output_dir, output_folders.RUN_LOCK_FILE)
    if not _run_locks:
        holder = atomic_files.lock_holder(lock_file)
        if holder is not None:
            parser.error(f"--output-dir {output_dir} is in use by another run (process {holder}, which holds "
                         f"{lock_file}); wait for it to finish, or choose another folder")  # fmt: skip
        return
    lock = checks.check_output(parser, atomic_files.hold_lock, lock_file, what=f"--output-dir {output_dir}")
    _run_locks[-1].append(lock)
    output_folders.recover_interrupted_saves(os.path.abspath(output_dir), run_folder_entry, held=True)


# What a killed save or removal leaves in the run folder (`output_folders.recover_interrupted_saves` restores or removes
# it).
LEFTOVER_ENTRIES = tuple(
    f".{pattern}.{kind}-[0-9]*-*" for pattern in RUN_FOLDER_ENTRIES for kind in output_folders.LEFTOVER_KINDS
)


def run_folder_entry(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_FOLDER_ENTRIES)


def check_run_folder_contents(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--output-dir holds only what this recipe writes; an earlier run's only with --overwrite-output-dir (which must
    be able to remove all of it: `output_folders.earlier_run_entries`) or --resume (of that run: a checkpoint from
    elsewhere may not continue into another run's folder)."""
    checks.check_output(parser, output_folders.check_run_folder, args.output_dir, argument="--output-dir",
                        written=RUN_FOLDER_ENTRIES + LEFTOVER_ENTRIES, checkpoints=RUN_FOLDER_CHECKPOINTS)  # fmt: skip
    resume_here = args.resume == "latest" or (args.resume and in_folder(args.resume, args.output_dir))
    if args.overwrite_output_dir and resume_here:
        named = "--resume" if args.resume == "latest" else f"--resume {args.resume}"
        parser.error(f"{named} continues the run in --output-dir {args.output_dir}, which "
                     "--overwrite-output-dir removes; leave out --overwrite-output-dir to continue that run, or "
                     "--resume to replace it with a new one")  # fmt: skip
    if args.overwrite_output_dir:
        checks.check_output(parser, output_folders.earlier_run_entries, args.output_dir, written=RUN_FOLDER_ENTRIES,
                            files=RUN_RESULT_FILES)  # fmt: skip
        return
    earlier = os.path.isdir(args.output_dir) and any(
        entry.name != output_folders.RUN_LOCK_FILE for entry in os.scandir(args.output_dir)
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
        record = checks.check_output(parser, output_folders.read_run_record, args.output_dir)
        stamp = checks.check_output(parser, output_folders.saved_run_id, args.resume)
        if record is None or record["run_id"] != stamp:
            held = f"run {record['run_id']}" if record else "a run without a run record"
            parser.error(f"--resume {args.resume}: --output-dir {args.output_dir} holds another run ({held}), which "
                         "this one would mix with; pass --overwrite-output-dir to replace it, or choose another "
                         "--output-dir")  # fmt: skip


def in_folder(path: str, folder: str) -> bool:
    """Whether `path` is an entry of `folder` itself (not further down)."""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    return os.path.realpath(parent) == os.path.realpath(folder)


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
            data = checkpoint_checks.read_json_file(path, "a model config")
            data = (data.get(key, {}) if key else data) if isinstance(data, dict) else {}
            if data:
                return data
    return {}


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
    stamp = output_folders.saved_run_id(checkpoint)
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
    saved in full (its save record carries the run's id, `output_folders.RUN_RECORD_FILE`), saying in one line which it
    skipped; in a folder without a run record (of an older damcha-hf, or a checkpoint copied in) any complete one. A
    checkpoint named in `output_dir` itself must be one of that run's too."""
    if resume is None:
        return None
    record = output_folders.read_run_record(output_dir) if os.path.isdir(output_dir) else None
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
    unrecorded = output_folders.saved_files(resume) is None and os.path.basename(os.path.normpath(resume)) not in (
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
    state = checkpoint_checks.read_json_file(os.path.join(checkpoint, marker), "the training state")
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
    checkpoint_checks.check_checkpoint_files(checkpoint)
    step = checkpoint_step(checkpoint, marker)
    problems = []
    for pattern, what in {} if args.resume_weights_only else state.items():
        found = sorted(glob.glob(os.path.join(glob.escape(checkpoint), pattern)))
        if not found:
            problems.append(f"{os.path.join(checkpoint, pattern)} ({what}) is missing")
        for path in found:
            try:
                checkpoint_checks.check_pickled_archive(path, what)
            except checkpoint_checks.CorruptFileError as error:
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
    the step count, not the optimizer, schedule or random state. (The Trainer has no public switch for a partial
    resume, so its two loaders of that state are turned off on this instance.)"""
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
    (`output_folders.record_run_entry`): so --resume continues only this run's checkpoints, and --overwrite-output-dir
    later removes only what the run wrote. Only the first process of a launch (`main`) writes the records."""

    def __init__(self, output_dir: str, run_id: str, *, resume: str | None, keep: int | None, main: bool = True):
        self.output_dir, self.run_id, self.resume, self.keep, self.main = output_dir, run_id, resume, keep, main

    def writing(self, folder: str) -> None:
        """Before the run writes `folder` (an entry of --output-dir) in place: name it in the run record."""
        if self.main:
            output_folders.record_run_entry(self.output_dir, self.run_id, os.path.basename(os.path.normpath(folder)))

    def wrote(self, folder: str) -> None:
        """Once `folder` is written: record its files with the run's id and, for a checkpoint, keep only the newest
        --save-total-limit of the run's checkpoints (`remove_old_checkpoints`)."""
        if not self.main:
            return
        output_folders.write_save_record(folder, run_id=self.run_id)
        if self.keep and os.path.basename(os.path.normpath(folder)).startswith("checkpoint-"):
            self.remove_old_checkpoints(folder)

    def remove_old_checkpoints(self, newest: str) -> None:
        """--save-total-limit: delete the oldest of this run's checkpoints beyond the newest `keep` (never `newest`,
        the one just saved), each only if it holds nothing but what its save recorded. Unlike the Trainer's own
        rotation, which deletes any `checkpoint-*` folder, another run's checkpoints and a user's are never touched."""
        own = []
        for _, checkpoint in run_checkpoints(self.output_dir, output_folders.SAVE_RECORD_FILE):
            try:
                if output_folders.saved_run_id(checkpoint) == self.run_id:
                    own.append(checkpoint)
            except checkpoint_checks.CorruptFileError:
                continue
        older = [checkpoint for checkpoint in own if not os.path.samefile(checkpoint, newest)]
        for checkpoint in older[max(0, self.keep - 1) :]:
            foreign = output_folders.foreign_entries(Path(checkpoint))
            if foreign:
                print(f"--save-total-limit: keeping {checkpoint}, which holds files its save did not write "
                      f"({', '.join(foreign[:5])})", file=sys.stderr, flush=True)  # fmt: skip
                continue
            output_folders.remove_entries([checkpoint])

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
    earlier run goes, as far as its records say it wrote it (`output_folders.earlier_run_entries`, checked again; each
    entry renamed aside, then deleted, so that a kill leaves nothing half-removed), said in one line. A resumed run
    keeps its id (its checkpoint's, else the folder's) and drops the saves it left unfinished; a new run gets a new
    id. Under a multi-process launch only the first process touches the folder."""
    main = os.environ.get("RANK", "0") == "0"
    output_dir = args.output_dir
    if main and args.overwrite_output_dir:
        entries = output_folders.earlier_run_entries(output_dir, written=RUN_FOLDER_ENTRIES, files=RUN_RESULT_FILES)
        if entries:
            removed = output_folders.remove_entries(entries)
            shown = [name for name in removed if name != output_folders.RUN_RECORD_FILE]
            print(f"--overwrite-output-dir: removed the earlier run in {output_dir} ({', '.join(shown) or 'its record'})",
                  flush=True)  # fmt: skip
    record = output_folders.read_run_record(output_dir) if os.path.isdir(output_dir) else None
    run_id = None
    if resume:
        run_id = output_folders.saved_run_id(resume) or (record["run_id"] if record else None)
    run = Run(output_dir, run_id or output_folders.new_run_id(), resume=resume, keep=args.save_total_limit, main=main)
    if main and record and record["run_id"] == run.run_id:
        unfinished = [
            os.path.join(output_dir, name)
            for name in record["entries"]
            if name.startswith("checkpoint-")
            and os.path.isdir(os.path.join(output_dir, name))
            and not os.path.islink(os.path.join(output_dir, name))
            and output_folders.saved_files(os.path.join(output_dir, name)) is None
        ]
        if unfinished:
            removed = output_folders.remove_entries(unfinished)
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

        model = trainer.model
        with checkpoint_checks.loading_checkpoint(resume, "the --resume checkpoint"):
            loaded = type(model).from_pretrained(resume, attn_implementation=model.config._attn_implementation)
        model.load_state_dict(loaded.state_dict())
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
    with checkpoint_checks.loading_checkpoint(resume, "the --resume checkpoint"):
        return auto_class.from_pretrained(resume, attn_implementation=attn)


def print_evaluation(metrics: dict) -> None:
    """The evaluation figures and the step reached, on one line of the run's output."""
    print({key: value for key, value in metrics.items() if key.startswith("eval_") or key == "global_step"})


def finish_run(args: argparse.Namespace, final: str, metrics: dict, saved_note: str = "") -> None:
    """After the final save: `<output-dir>/eval_results.json`, and the push of `final` with --push-to-hub."""
    atomic_files.write_json(os.path.join(args.output_dir, "eval_results.json"), metrics)
    print(f"saved to {final}{saved_note}")
    push_final_model(args, final)


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


def card_datasets(data: str) -> list[str]:
    """The model card's `datasets:` for a --data value: a local path is named by its base name only, never the
    path (a push would publish it); 'stdlib' and 'gcide' by what they are."""
    public = {"stdlib": "python-stdlib-sources", "gcide": "gcide", "fashion-mnist": "fashion_mnist"}
    if data in public:
        return [public[data]]
    from damcha_hf.hub.file_rules import public_dataset_name

    name = public_dataset_name(data)
    return [name] if name else []
