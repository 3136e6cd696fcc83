"""The recipes' command-line options: the shared argument groups (metric, training), the checks that need several
arguments or the disk (`parse_checked`), the attention backend a metric needs, and the `TrainingArguments` they make.

Parsing imports only the standard library and the torch-free parts of damcha_hf (torch and transformers come after it), so
`--help` is instant and a bad argument or output folder fails at once, before any data is loaded. Errors end a recipe
with one line on stderr and exit code 2; `--debug` or `DAMCHA_HF_DEBUG=1` shows the traceback (`run_recipe`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import types
import typing

import run_folder

from damcha_hf import argument_checks as checks
from damcha_hf.modeling import damcha_config as options
from damcha_hf.modeling import variants
from damcha_hf.safe_files import checkpoint_checks

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def add_metric_arguments(parser: argparse.ArgumentParser) -> None:
    """Every attention-variant field of a DAMCHA config (`cross_head_variant`, DAMCHA's `metric_*`, each baseline's
    own), as a flag named after it (`--metric-context`); defaults: the config's own."""
    group = parser.add_argument_group("attention variant (defaults: the config's)")
    for name, field in options.VARIANT_FIELDS.items():
        kind = {"choices": field.rule.choices} if field.rule.choices else {"type": field_value_parser(field)}
        help_text = f"{field.help} ({variants.variants_help()})" if name == "cross_head_variant" else field.help
        group.add_argument(f"--{name.replace('_', '-')}", **kind, help=help_text)
    eager_only = " and ".join(variants.eager_only_variants())
    group.add_argument(
        "--attn",
        choices=ATTENTION_IMPLEMENTATIONS,
        help=f"attention implementation (default: sdpa; eager for {eager_only} and --metric-form scores, which mix "
        "the score maps that only eager attention materialises)",
    )


METRIC_FIELDS = tuple(options.VARIANT_FIELDS)


def field_value_parser(field):
    """The argparse `type` of a config field's flag: its declared type (`int`, `float`, `int | None`) and the range
    its rule accepts, so a flag takes exactly what the config does (`--moa-z-loss-coef 0`, `--moa-top-k 2`)."""
    declared = typing.get_args(field.type) or (field.type,)
    kind = float if float in declared else int if int in declared else str

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            words = {int: "an integer", float: "a number"}.get(kind, f"a {kind.__name__}")
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if not field.rule.accepts(value):
            description = re.sub(r", or None for .*$", "", field.rule.description)  # a flag left out is the None
            raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}; {field.rule.fix}")
        return value

    parse.__name__ = kind.__name__
    return parse


def resolve_attention(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--attn: sdpa by default, eager for a variant (or --metric-form) that runs only in eager attention, which refuses
    any other backend."""
    variant = getattr(args, "cross_head_variant", None) or variants.DEFAULT_VARIANT
    backends = variants.backends_of(variant, metric_form=getattr(args, "metric_form", None))
    eager_only = backends == ("eager",)
    if args.attn is None:
        args.attn = "eager" if eager_only else "sdpa"
    elif eager_only and args.attn != "eager":
        chosen = (
            f"--cross-head-variant {variant}" if variants.backends_of(variant) == ("eager",) else "--metric-form scores"
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
    run_folder.hold_run_folder(parser, args.output_dir)
    run_folder.check_run_folder_contents(parser, args)
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


def explicit_destinations(parser: argparse.ArgumentParser, argv=None) -> set[str]:
    """The `dest` of every option given on the command line (not left at its default)."""
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = bare.parse_known_args(argv)
    return set(vars(namespace))


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


def training_arguments(args: argparse.Namespace, *, seq2seq: bool = False, arguments_class=None, **overrides):
    """`TrainingArguments` from the shared options (`Seq2SeqTrainingArguments` for `seq2seq`; `arguments_class`, a
    subclass such as TRL's `SFTConfig`, when given)."""
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
    if arguments_class is None:
        arguments_class = Seq2SeqTrainingArguments if seq2seq else TrainingArguments
    return arguments_class(**kwargs)


def check_push(args: argparse.Namespace, *, accelerate: bool = False) -> None:
    """Before any data is loaded: --report-to's trackers are installed (`check_report_to`) and, with --push-to-hub,
    a token is at hand (`damcha_hf.hub.check_can_push`)."""
    check_report_to(args, accelerate=accelerate)
    if args.push_to_hub:
        from damcha_hf.hub import check_can_push

        check_can_push(None)


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


# The config fields of a model's shape as a checkpoint's config.json may name them (GPT-2's, BART's, the rest's).
SHAPE_FIELDS = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "encoder_attention_heads"),
    "num_key_value_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def variant_owning(field: str) -> str:
    """The `cross_head_variant` whose own field `field` is (`colmha_key_dim`: colmha)."""
    return next(name for name, variant in variants.VARIANTS.items() if field in variant.fields)


def check_vit_init_and_variant_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                                     variant_flags: bool = True) -> None:  # fmt: skip
    """The ViT recipes' `--init-from` (a folder whose files are whole, named before any data is read) and, where
    `variant_flags`, their variant flags against the model `--hidden-size` and `--num-heads` build."""
    if args.init_from:
        if not os.path.isdir(args.init_from):
            parser.error(f"--init-from {args.init_from}: no such checkpoint folder")
        checks.check_output(parser, checkpoint_checks.check_checkpoint_files, args.init_from)
    if variant_flags:
        check_variant_flags(
            parser,
            args,
            sizes={"hidden_size": args.hidden_size, "num_attention_heads": args.num_heads},
            size_flags={"hidden_size": "--hidden-size", "num_attention_heads": "--num-heads"},
            checkpoint=args.init_from,
        )


def check_variant_flags(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    sizes: dict | None = None,
    size_flags: dict | None = None,
    model_type: str | None = None,
    checkpoint: str | None = None,
    checkpoint_flag: str = "--init-from",
    converts_plain_checkpoint: bool = False,
    extra_flags: tuple[str, ...] = (),
) -> None:
    """The attention-variant flags given, refused while parsing (one line naming the flag and the fix) where the model
    would ignore them or where the config they build would refuse them:

    - a plain `model_type` (`gpt2`, `llama`, `bart`: multi-head attention, no variant fields), and a plain
      `checkpoint` unless the recipe converts it (`converts_plain_checkpoint`: `finetune_lora.py --base`);
    - another variant's fields (`--colmha-key-dim` where the variant is DAMCHA);
    - on a DAMCHA checkpoint whose variant is not `none`, any value other than the checkpoint's: the variant's trained
      weights would be dropped or read under other settings, so training would not start from the checkpoint's
      function. From an MHA checkpoint (`cross_head_variant="none"`) every variant flag applies, each variant starting
      as that checkpoint's function (exactly, but for MoA with fewer than all heads kept);
    - the config the flags build, validated as the config class validates it (`moa_top_k` beyond the heads, a
      `colmha_key_dim` wider than the heads, ColMHA on grouped-query heads), its config fields named by their flags.

    `sizes`: the new model's shape (`hidden_size`, `num_attention_heads`, `num_key_value_heads`) and `size_flags` the
    flags that set them; with `checkpoint` the shape is the checkpoint's. `extra_flags`: a recipe's own DAMCHA-only
    flags (BART's `encoder_metric_context`), refused with the variant flags on a plain model type."""
    given = metric_options(args)
    extras = [name for name in extra_flags if getattr(args, name, None) is not None]
    named = ", ".join(flag_name(name) for name in [*given, *extras])
    if model_type is not None and not model_type.startswith("damcha") and (given or extras):
        verb = "applies" if len(given) + len(extras) == 1 else "apply"
        parser.error(f"--model-type {model_type} is plain {model_type} (multi-head attention, no cross-head variant), "
                     f"which would ignore it: {named} {verb} to damcha_{model_type}; use --model-type "
                     f"damcha_{model_type}, or leave {named} out")  # fmt: skip
    if not given or getattr(args, "resume", None):
        return  # on --resume the checkpoint's settings win (`run_folder.check_resume_settings`)
    saved: dict = {}
    if checkpoint:
        saved = run_folder.saved_model_config(checkpoint)
        saved_type = str(saved.get("model_type"))
        if not saved_type.startswith("damcha_"):
            if not converts_plain_checkpoint:
                parser.error(f"{checkpoint_flag} {checkpoint} holds a plain {saved_type} model (multi-head attention, "
                             f"no cross-head variant), which would ignore {named}; convert it first "
                             "(damcha_hf.convert_to_damcha(model, ...), then save_pretrained) and pass that folder, "
                             f"or leave {named} out")  # fmt: skip
            saved = {key: value for key, value in saved.items() if key not in options.VARIANT_FIELDS}
        else:
            saved_variant = saved.get("cross_head_variant", variants.DEFAULT_VARIANT)
            defaults = {name: field.default for name, field in options.VARIANT_FIELDS.items()}
            changed = [name for name, value in given.items() if saved.get(name, defaults[name]) != value]
            if saved_variant != "none" and changed:
                name = changed[0]
                parser.error(f"{flag_name(name)} {given[name]}: the {checkpoint_flag} checkpoint's attention is "
                             f"{saved_variant} with {name}={saved.get(name, defaults[name])}, as it was trained; "
                             "another value would drop its trained weights or read them under other settings, so "
                             f"training would not start from its function. Leave {flag_name(name)} out (the "
                             "checkpoint's value is used), or start from an MHA checkpoint (cross_head_variant none), "
                             "where every variant flag applies, or from a new model")  # fmt: skip
    if "cross_head_variant" in given:
        variant, source = given["cross_head_variant"], "given"
    elif "cross_head_variant" in saved:
        variant, source = saved["cross_head_variant"], f"the {checkpoint_flag} checkpoint's"
    else:
        variant, source = variants.DEFAULT_VARIANT, "the default"
    for name in given:
        owner = variant_owning(name) if name != "cross_head_variant" else variant
        if owner != variant:
            parser.error(f"{flag_name(name)} is a setting of --cross-head-variant {owner}, not of {variant} "
                         f"({source}), which would ignore it; add --cross-head-variant {owner}, or leave "
                         f"{flag_name(name)} out")  # fmt: skip
    check_flags_build_a_valid_config(parser, given, saved, sizes if not checkpoint else None, size_flags)


class ConfigOfTheFlags(types.SimpleNamespace):
    """The fields a recipe's flags would give a DAMCHA config, for the config's own checks."""


def check_flags_build_a_valid_config(parser, given: dict, saved: dict, sizes, size_flags) -> None:
    """Run the checks a DAMCHA config makes across its fields (the variant's `config_refusal` and
    `head_layout_refusal`, as `check_metric_options` and `check_key_value_heads` run them) on the fields the flags
    would give it, while parsing; a refusal names the flags, not the config fields."""
    values = {name: field.default for name, field in options.VARIANT_FIELDS.items()}
    values.update({name: value for name, value in saved.items() if name in values})
    values.update(given)
    if sizes is None:  # a checkpoint's shape, under whichever names its config.json uses
        sizes = {}
        for field, names in SHAPE_FIELDS.items():
            found = next((saved[name] for name in names if isinstance(saved.get(name), int)), None)
            if found is not None:
                sizes[field] = found
        if "hidden_size" not in sizes or "num_attention_heads" not in sizes:
            return  # not a shape this check reads: the config checks itself when the model is loaded
    config = ConfigOfTheFlags(**values, **sizes)
    heads = sizes["num_attention_heads"]
    key_value_heads = sizes.get("num_key_value_heads") or heads
    # Each flag's own range was checked as it was parsed, and the shape by the recipe's size checks (or when the
    # checkpoint was saved): what is left is what the variant checks across fields.
    variant = variants.variant_of(config)
    refusal = variant.config_refusal(config) or variant.head_layout_refusal(config, heads, key_value_heads)
    if refusal:
        flags = {name: flag_name(name) for name in options.VARIANT_FIELDS}
        flags.update(size_flags or {})
        parser.error(flag_message(refusal, flags))


def flag_message(message: str, flags: dict[str, str]) -> str:
    """A config's error message with each config field it names (`moa_top_k`, `cross_head_variant='damcha'`) written
    as the flag that sets it (`--moa-top-k`, `--cross-head-variant damcha`); the config's class name dropped."""
    message = re.sub(rf"^{ConfigOfTheFlags.__name__}: ", "", message)

    def as_flag(match: re.Match) -> str:
        field, value = match.group(1), match.group(2)
        if field not in flags:
            return match.group(0)
        return flags[field] + (f" {value.strip(chr(39) + chr(34))}" if value is not None else "")

    message = re.sub(r"`(\w+)(?:=([^`]*))?`", as_flag, message)
    # What a config sets to None, a command line leaves out; a quoted value is the flag's bare word.
    return re.sub(r"`'(\w+)'`", r"\1", message.replace("or None for", "or leave the flag out for"))


def check_language_model_variant_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`check_variant_flags` for the language-model recipes: a new model's shape is --n-embd, --n-head and --n-kv-head
    (`--model-type gpt2` or `llama` is plain attention); with --init-from, the checkpoint's."""
    checkpoint = getattr(args, "init_from", None)
    check_variant_flags(
        parser,
        args,
        model_type=None if checkpoint else args.model_type,
        sizes={"hidden_size": args.n_embd, "num_attention_heads": args.n_head, "num_key_value_heads": args.n_kv_head},
        size_flags={"hidden_size": "--n-embd", "num_attention_heads": "--n-head", "num_key_value_heads": "--n-kv-head"},
        checkpoint=checkpoint,
    )
