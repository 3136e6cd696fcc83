"""Starting a recipe from a pretrained checkpoint (`--model-name-or-path`, a Hub id or a local folder, as transformers'
`run_clm.py` spells it): a stock checkpoint of a supported family is converted to DAMCHA (`damcha_hf.convert_to_damcha`:
every weight kept, the cross-head modules at exact multi-head attention, so the outputs are unchanged before the first
step); a DAMCHA checkpoint is fine-tuned as it is. The checkpoint's own tokenizer or image processor is used.

Checking the flag imports only the standard library for a local folder; a Hub id is resolved with transformers'
`AutoConfig` (its config.json alone is downloaded) before any data is read.
"""

from __future__ import annotations

import argparse
import json
import os

import recipe_options

from damcha_hf import argument_checks as checks
from damcha_hf.safe_files import checkpoint_checks

# The task a recipe trains, and the families whose task head fits it.
CAUSAL_LM, IMAGE_CLASSIFICATION, SEQ2SEQ = "causal language modelling", "image classification", "sequence to sequence"
RECIPE_OF_TASK = {
    CAUSAL_LM: "recipes/train_gpt2.py (or recipes/train_sft.py)",
    IMAGE_CLASSIFICATION: "recipes/train_vit.py",
    SEQ2SEQ: "recipes/train_bart.py",
}


def family_task(family) -> str:
    if family.encoder_decoder:
        return SEQ2SEQ
    return IMAGE_CLASSIFICATION if family.vision else CAUSAL_LM


def add_pretrained_argument(parser: argparse.ArgumentParser, families: str) -> None:
    """`--model-name-or-path`. (`--init-from`, where a recipe has it, loads a checkpoint as it is: a stock one stays
    stock; the two are refused together.)"""
    parser.add_argument(
        "--model-name-or-path",
        metavar="MODEL",
        help=f"start from this pretrained checkpoint, a Hub id or a local folder, instead of a new model: a stock "
        f"{families} checkpoint is converted to DAMCHA (every weight kept, outputs unchanged before the first step; "
        "the --metric-* and --cross-head-variant flags choose the conversion), a DAMCHA checkpoint is fine-tuned as it "
        "is; its own tokenizer or image processor is used",
    )


def check_one_start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "init_from", None) and args.model_name_or_path:
        parser.error("--init-from and --model-name-or-path both name the checkpoint to start from; give one: "
                     "--model-name-or-path converts a stock checkpoint to DAMCHA, --init-from loads one as it is")  # fmt: skip


def is_local(path: str) -> bool:
    return os.path.exists(path) or os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


def config_folder(args: argparse.Namespace) -> str:
    """The folder holding the checkpoint's config.json: a local folder (checked: a checkpoint, its files whole), or the
    download of a Hub id's config.json alone (transformers' cache). Errors name the flag and the fix."""
    path = args.model_name_or_path
    flag = f"--model-name-or-path {path}"
    if is_local(path):
        if not os.path.isdir(path):
            raise ValueError(f"{flag}: no such checkpoint folder (a Hub id is written owner/name)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{flag}: not a checkpoint folder (no config.json); give the folder save_pretrained wrote")
        checkpoint_checks.check_checkpoint_files(path)  # a damaged file is named now, before any data is read
        return path
    offline = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
               if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")]  # fmt: skip
    from transformers.utils import cached_file

    try:
        downloaded = cached_file(path, "config.json")
    except OSError as error:
        where = f"the Hub is in offline mode ({offline[0]}=1) and it is not in the cache" if offline else str(error)
        raise ValueError(f"{flag}: no such local folder, and no model on the Hub could be read ({where.splitlines()[0]}); "
                         "give a checkpoint folder or a Hub id such as openai-community/gpt2") from None  # fmt: skip
    return os.path.dirname(downloaded)


def check_pretrained(parser: argparse.ArgumentParser, args: argparse.Namespace, task: str, *,
                     new_model_flags: tuple[str, ...]) -> None:  # fmt: skip
    """With --model-name-or-path: the checkpoint is readable, of a family whose task head this recipe trains; the flags
    of a new model are refused (the checkpoint decides its shape); on a DAMCHA checkpoint a variant flag that differs
    from its config is refused (it is fine-tuned as it is). Sets `args.pretrained_family` and
    `args.pretrained_is_stock` and `args.pretrained_config` (the saved config, a dict)."""
    args.pretrained_family, args.pretrained_is_stock, args.pretrained_config = None, False, {}
    args.pretrained_config_folder = None
    check_one_start(parser, args)
    if not args.model_name_or_path:
        return
    flag = f"--model-name-or-path {args.model_name_or_path}"
    given = [name for name in new_model_flags if name in args.explicit]
    if given:
        parser.error(f"--{given[0].replace('_', '-')} sets the shape of a new model; {flag} brings its own: leave "
                     f"--{given[0].replace('_', '-')} out, or leave --model-name-or-path out to train a new model")  # fmt: skip
    try:
        args.pretrained_config_folder = config_folder(args)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    with open(os.path.join(args.pretrained_config_folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    from damcha_hf.families import FAMILIES, family_for_model_type, supported_architectures

    model_type = config.get("model_type")
    family = family_for_model_type(model_type)
    if family is None or family not in FAMILIES:
        fitting = supported_architectures([f for f in FAMILIES if family_task(f) == task])
        parser.error(f"{flag}: a {model_type!r} checkpoint, which damcha_hf does not convert; this recipe trains "
                     f"{fitting} checkpoints and their DAMCHA versions")  # fmt: skip
    if family_task(family) != task:
        parser.error(f"{flag}: a {family.display_name} checkpoint ({family_task(family)}); this recipe trains "
                     f"{task}: use {RECIPE_OF_TASK[family_task(family)]}")  # fmt: skip
    args.pretrained_family, args.pretrained_is_stock = family, model_type == family.model_type
    args.pretrained_config = config
    # The variant flags: they choose a stock checkpoint's conversion; on a DAMCHA checkpoint they apply where its
    # variant is `none` (multi-head attention) and are refused where they differ from the variant it was trained with.
    recipe_options.check_variant_flags(parser, args, checkpoint=args.pretrained_config_folder,
                                       checkpoint_flag="--model-name-or-path", converts_plain_checkpoint=True)  # fmt: skip
    if args.attn == "sdpa" and not family.task_head.model_class._supports_sdpa:
        if "attn" in args.explicit:
            parser.error(f"--attn sdpa: {family.display_name} models run eager, flash or flex attention, not SDPA (as "
                         "in transformers); use --attn eager")  # fmt: skip
        args.attn = "eager"  # Gemma 2 soft-caps its attention logits, which SDPA cannot


def cap_at_checkpoint_context(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """A token-length flag (`name`, e.g. `block_size`) at most the --model-name-or-path checkpoint's context length:
    refused above it when given, lowered to it when it was only the default."""
    context = args.pretrained_config.get("max_position_embeddings", args.pretrained_config.get("n_positions"))
    value = getattr(args, name)
    if context is None or value <= context:
        return
    flag = "--" + name.replace("_", "-")
    if name in args.explicit:
        parser.error(f"{flag} {value} exceeds the --model-name-or-path checkpoint's context length ({context} tokens); "
                     f"use {flag} {context} or less")  # fmt: skip
    setattr(args, name, context)


def load_pretrained_model(args: argparse.Namespace, **load_options):
    """The model to train from --model-name-or-path: a stock checkpoint loaded with its transformers class and
    converted (`convert_to_damcha` with the variant flags), a DAMCHA checkpoint loaded through its Auto class.
    `load_options` go to `from_pretrained` (a classifier's new labels)."""
    import transformers

    import damcha_hf

    family, path = args.pretrained_family, args.model_name_or_path
    head = family.task_head
    with checkpoint_checks.loading_checkpoint(path, "the --model-name-or-path checkpoint"):
        if args.pretrained_is_stock:
            stock = head.stock_class.from_pretrained(path, attn_implementation=args.attn, **load_options)
            model = damcha_hf.convert_to_damcha(stock, **recipe_options.metric_options(args))
            print(f"converted the stock {family.display_name} checkpoint {path} ({type(stock).__name__}) to "
                  f"{type(model).__name__}: every weight kept, the cross-head modules at exact multi-head attention, "
                  "so training starts from the pretrained outputs", flush=True)  # fmt: skip
            return model
        auto_class = getattr(transformers, head.auto_class)
        # Variant flags reach here only for a checkpoint whose variant is `none` (`check_pretrained`): they apply.
        return auto_class.from_pretrained(path, attn_implementation=args.attn, **load_options,
                                          **recipe_options.metric_options(args))  # fmt: skip


def has_tokenizer(path: str) -> bool:
    """Whether a local checkpoint folder holds a tokenizer (a Hub id: assumed, as run_clm does)."""
    if not is_local(path):
        return True
    return any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json",
                                                                      "vocab.json"))  # fmt: skip


def load_pretrained_tokenizer(args: argparse.Namespace, *, max_length: int):
    """The checkpoint's own tokenizer, with a padding token (its end-of-text token where it has none, as GPT-2's
    tokenizer) and `model_max_length` the recipe's context."""
    from transformers import AutoTokenizer

    path = args.model_name_or_path
    if not has_tokenizer(path):
        raise ValueError(f"--model-name-or-path {path}: the checkpoint holds no tokenizer; save its tokenizer into the "
                         "folder (tokenizer.save_pretrained), or pass --tokenizer")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=max_length)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"--model-name-or-path {path}: its tokenizer has neither a padding nor an end-of-text "
                             "token to pad with; add one (tokenizer.add_special_tokens) and save it again")  # fmt: skip
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_pretrained_image_processor(args: argparse.Namespace):
    """The checkpoint's own image processor, or None where a local folder holds none."""
    from transformers import AutoImageProcessor

    path = args.model_name_or_path
    if is_local(path) and not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    return AutoImageProcessor.from_pretrained(path)


def card_base_model(args: argparse.Namespace) -> str | None:
    """The model card's `base_model`: the Hub id a run started from (a local folder is named nowhere)."""
    path = args.model_name_or_path
    if not path or is_local(path):
        return None
    try:
        return checks.hub_id(path)
    except argparse.ArgumentTypeError:
        return None
