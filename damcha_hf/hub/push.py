"""What a push uploads (the upload plan: weights, config, the remote code `auto_map` needs, preprocessor, card and
its images; only regular files inside the folder) and the push itself."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from transformers.dynamic_module_utils import get_relative_imports

from ..safe_files import MODEL_TYPE_PREFIX
from ..safe_files.checkpoint_checks import CorruptFileError, check_checkpoint_files, read_json_file, weight_files
from .file_rules import CARD_FILE, CONFIG_FILES, PREPROCESSOR_FILES
from .model_card import TOKENIZER_SUBFOLDER, card_for_repository

TEXT_SUFFIXES = (".json", ".md", ".py", ".txt", ".jinja")


class HubPushError(RuntimeError):
    """Pushing cannot start: offline, no token, or a folder that is not a clean Hub checkpoint."""


def auto_map_module(key: str, reference) -> str | None:
    """The module file an `auto_map` reference names (`"modeling_damcha_gpt2.DamchaGPT2Model"` ->
    `"modeling_damcha_gpt2"`); None for code in another Hub repository (`"owner/repo--module.Class"`), which is
    not a file of this folder. Anything but a plain module name (an absolute path, `..`, a folder) is refused: a push
    must never read a file outside the checkpoint folder."""
    if not isinstance(reference, str):
        return None  # e.g. a tokenizer's [slow, fast] pair: not code of this folder
    if "--" in reference:
        return None
    module, _, class_name = reference.rpartition(".")
    if not module.isidentifier() or not class_name.isidentifier():
        raise HubPushError(
            f"config.json's auto_map[{key!r}] = {reference!r} is not `module.Class` with a plain module name of a "
            "file in the checkpoint folder; re-save the model with `save_pretrained` after `import damcha_hf`, "
            "which writes a clean auto_map."
        )
    return module


def checked_file(folder: Path, name: str) -> Path | None:
    """`folder/name` when it is a regular file inside `folder` (a symbolic link, of the file or of the subfolder
    holding it, may point only at another file of the folder); None when it does not exist. Raises `HubPushError` for
    a link leaving the folder or a non-file."""
    path = folder / name
    if not path.exists() and not path.is_symlink():
        return None
    resolved = path.resolve()
    if folder.resolve() not in resolved.parents:
        raise HubPushError(
            f"{name} in {folder} is a symbolic link (or lies in a linked folder) to {resolved}, outside the checkpoint "
            "folder; replace it with the file itself (a push uploads only files inside the folder)."
        )
    if not resolved.is_file():
        raise HubPushError(f"{name} in {folder} is not a regular file; remove it or replace it with the file.")
    return path


def auto_map_code_files(folder: Path, auto_map: Mapping) -> list[str]:
    """The Python files `auto_map` names, plus everything they import with single-dot relative imports.

    The imports are found by transformers' own parser (`dynamic_module_utils.get_relative_imports`, what
    `from_pretrained(trust_remote_code=True)` uses to fetch a module's files), so the push uploads the files the loader
    asks for. Its recursive `get_relative_import_files` is not used: it would open whatever path an import names before
    we could check it, and a push must read only regular files inside the folder (`checked_file`, before reading)."""
    pending = [module for key, reference in auto_map.items() if (module := auto_map_module(key, reference))]
    seen: list[str] = []
    while pending:
        module = pending.pop()
        name = f"{module}.py"
        if name in seen:
            continue
        path = checked_file(folder, name)
        if path is None:
            raise HubPushError(
                f"{folder}: config.json's auto_map needs {name}, which is missing; re-save the model with "
                "`save_pretrained` (or `damcha_hf.hub.save_hub_checkpoint`) after `import damcha_hf`."
            )
        seen.append(name)
        for imported in sorted(get_relative_imports(path)):
            if imported.startswith("."):  # `from ..package import x`: outside the module's folder, not a file of it
                continue
            if not imported.isidentifier():  # `from .pkg.mod import x`: not a file of this folder
                raise HubPushError(f"{name} imports `.{imported}`, which is not a file of {folder}.")
            pending.append(imported)
    return sorted(seen)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")


def card_images(card_text: str) -> list[str]:
    """Image links of the card that name a file of its folder (`![alt](loss_curve.png)`); URLs, paths and other
    links are not followed."""
    names = []
    for link in IMAGE_LINK.findall(card_text):
        plain = link == os.path.basename(link) and "\\" not in link and ":" not in link and link not in (".", "..")
        if plain and link.lower().endswith(IMAGE_SUFFIXES):
            names.append(link)
    return names


IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def family_auto_map(model_type: str) -> dict[str, str]:
    """Every Auto class of a DAMCHA family (from `registration.AUTO_CLASS_TABLE`), as `auto_map` references."""
    from ..registration import AUTO_CLASS_TABLE

    def reference(cls) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    for config_class, model_classes in AUTO_CLASS_TABLE:
        if config_class.model_type == model_type:
            auto_map = {"AutoConfig": reference(config_class)}
            auto_map.update({auto_class.__name__: reference(model_class) for auto_class, model_class in model_classes})
            return auto_map
    return {}


def completed_config(folder: Path) -> tuple[dict, bool]:
    """`config.json` with `auto_map` listing exactly the model family's classes (a checkpoint of one head then loads
    with every Auto class under remote code, whichever class saved it; entries naming other code, e.g. carried over
    from a downloaded checkpoint, are dropped); and whether that changed it."""
    config = read_json_file(folder / "config.json", "a config")
    if not isinstance(config, dict):
        raise CorruptFileError(f"{folder / 'config.json'}: not a config (a JSON object)")
    auto_map = config.get("auto_map") or {}
    family = family_auto_map(config.get("model_type", ""))
    completed = (family or auto_map) if auto_map else auto_map
    changed = completed != auto_map
    config["auto_map"] = completed
    return config, changed


def config_json_bytes(config: dict) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")  # as transformers writes it


def upload_plan(folder: str | os.PathLike) -> dict[str, Path]:
    """`{path in repo: local file}` of what a push uploads: weights, config, code, preprocessor, card, images.

    Only the checkpoint's own files, by exact name: the weights its loader reads (the shards its safetensors index
    lists, else `model.safetensors`), never any other `*.safetensors` of the folder. Raises `HubPushError` when the
    folder is not a complete safetensors checkpoint with its code, and `CorruptFileError` (naming the file) for a
    damaged config or weight file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(
            f"{folder} is not a folder: pass a folder written by save_pretrained or save_hub_checkpoint."
        )
    if checked_file(folder, "config.json") is None and checked_file(folder, ADAPTER_CONFIG) is not None:
        return adapter_upload_plan(folder)
    if checked_file(folder, "config.json") is None:
        raise HubPushError(
            f"{folder} has no config.json: pass a folder written by save_pretrained or save_hub_checkpoint."
        )
    check_checkpoint_files(folder)
    weights = [name for name in weight_files(folder) if checked_file(folder, name)]
    if not weights:
        legacy = [path.name for path in folder.glob("*.bin") if path.name.startswith("pytorch_model")]
        hint = f" (found {', '.join(legacy)}: pickled weights are not uploaded)" if legacy else ""
        raise HubPushError(
            f"{folder} has no safetensors weights{hint}; re-save with `model.save_pretrained(folder)`, which writes "
            "model.safetensors."
        )
    saved_auto_map = read_json_file(folder / "config.json").get("auto_map") or {}  # a JSON object: checked above
    for key, reference in saved_auto_map.items():  # refuse absolute or `..` references, even those the push drops
        auto_map_module(key, reference)
    config, _ = completed_config(folder)
    # A stock checkpoint (an MHA baseline trained by a recipe) loads with transformers alone; a DAMCHA one needs its code.
    if not config.get("auto_map") and str(config.get("model_type", "")).startswith(MODEL_TYPE_PREFIX):
        raise HubPushError(
            f"{folder}/config.json has no auto_map, so the checkpoint would not load without damcha-hf; re-save it "
            "after `import damcha_hf` (which registers the classes for remote code)."
        )
    names = list(CONFIG_FILES) + weights
    names += auto_map_code_files(folder, config.get("auto_map") or {}) + list(PREPROCESSOR_FILES)
    names += [f"{TOKENIZER_SUBFOLDER}/{name}" for name in PREPROCESSOR_FILES]
    return checked_plan(folder, names)


def checked_plan(folder: Path, names: list[str]) -> dict[str, Path]:
    """`{name: file}` for each of `names` that is a regular file inside `folder`, plus the card and its images."""
    card = checked_file(folder, CARD_FILE)
    if card is not None:
        names = [*names, CARD_FILE, *card_images(card.read_text(encoding="utf-8"))]
    plan = {}
    for name in dict.fromkeys(names):
        path = checked_file(folder, name)
        if path is not None:
            plan[name] = path
    return plan


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_upload_plan(folder: Path) -> dict[str, Path]:
    """What a push of a PEFT adapter folder uploads: its config, safetensors weights, tokenizer or processor files,
    card and the images it shows. Its `base_model_name_or_path` must be a Hub id (a path means nothing to others)."""
    if checked_file(folder, ADAPTER_WEIGHTS) is None:
        raise HubPushError(
            f"{folder} has no {ADAPTER_WEIGHTS}; re-save the adapter with `peft_model.save_pretrained(folder)`."
        )
    check_checkpoint_files(folder)
    adapter_config = read_json_file(folder / ADAPTER_CONFIG, "an adapter config")
    base = (adapter_config.get("base_model_name_or_path") if isinstance(adapter_config, dict) else None) or ""
    if not re.fullmatch(r"([\w.-]+/)?[\w.-]+", base) or os.path.exists(base) or base.startswith("."):
        raise HubPushError(
            f"{folder}/{ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a Hub id, so the pushed adapter would "
            "not load for anyone else. Publish the base model first and train (or re-save) the adapter with its Hub "
            "id, e.g. `finetune_lora.py --base-model-id your-name/base`."
        )
    return checked_plan(folder, [ADAPTER_CONFIG, ADAPTER_WEIGHTS, *PREPROCESSOR_FILES])


def local_path_markers(folder: Path, extra: Iterable[Path] = ()) -> list[str]:
    """Absolute paths that must not appear in a public file: the folder, its parent, the home folder."""
    markers = set()
    for path in [folder, *extra]:
        for variant in (Path(path).absolute(), Path(path).resolve()):
            markers.update({str(variant), str(variant.parent)})
    home = str(Path.home())
    if len(home) > 1:
        markers.add(home)
    return sorted(marker for marker in markers if len(marker) > 1)


def check_no_local_paths(folder: Path, files: Iterable[Path], extra: Iterable[Path] = ()) -> None:
    markers = local_path_markers(folder, extra)
    for path in files:
        if path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for marker in markers:
            if marker in text:
                raise HubPushError(
                    f"{path.name} contains the local path {marker!r}; remove it before sharing the file."
                )


def check_can_push(token: str | None) -> str:
    """Fail before any network call when offline or without a token; returns the token to use."""
    from huggingface_hub import constants, get_token

    flags = [
        name
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
    ]
    if flags or constants.HF_HUB_OFFLINE:
        raise HubPushError(
            f"cannot push: Hugging Face Hub offline mode is on ({', '.join(flags) or 'HF_HUB_OFFLINE'}=1). "
            "Unset it (e.g. `HF_HUB_OFFLINE=0 damcha-hf push ...`) on a machine with network access."
        )
    token = token or get_token()
    if not token:
        raise HubPushError(
            "cannot push: no Hugging Face token. Pass --token (token=...), set HF_TOKEN, or run `hf auth login`; "
            "the token needs write access."
        )
    return token


def push_checkpoint(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload DAMCHA checkpoint",
) -> str:
    """Upload a checkpoint folder to the Hub model repository `repo_id` (created if needed); returns the commit URL.

    Uploads only the safetensors weights, config files (`config.json` with its `auto_map` completed to every Auto
    class of the family), the model code named by `auto_map`, tokenizer or image processor files, `README.md` (with the repository id written into its loading snippets, where they named the placeholder id or the
    local folder: `model_card.card_for_repository`) and the images it shows:
    never optimizer, scheduler, RNG or trainer state. Raises `HubPushError`, before any network call, when offline
    (`HF_HUB_OFFLINE=1`), without a token, or when a file would leak a local path.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    token = check_can_push(token)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubPushError(f"repo_id {repo_id!r} is not a valid Hub id ('name' or 'namespace/name'): {error}") from None
    folder = Path(folder)
    plan = upload_plan(folder)
    check_no_local_paths(folder, plan.values())
    api = HfApi(token=token)
    with _one_line_push_errors(repo_id, token):
        # The full id (`namespace/name`): a bare name is created in the token owner's namespace, and the card's
        # loading snippets must name the repository as others reach it.
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    operations = []
    for path_in_repo, path in plan.items():
        content = str(path)
        if path_in_repo == CARD_FILE:
            content = card_for_repository(path.read_text(encoding="utf-8"), repo_id).encode("utf-8")
        elif path_in_repo == "config.json":
            config, changed = completed_config(folder)
            content = config_json_bytes(config) if changed else content
        operations.append(CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=content))
    with _one_line_push_errors(repo_id, token):
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.create_commit(
            repo_id, operations=operations, commit_message=commit_message, revision=revision, repo_type="model"
        )
    return commit.commit_url


# A shorter piece of a token is too common a string to mask everywhere it occurs; one this long identifies it.
SECRET_PIECE = 8


def without_secret(text: str, secret: str) -> str:
    """`text` with every run of characters that contains a piece of `secret` at least SECRET_PIECE long (the whole
    token, the token cut short, its end) replaced by `<token>`."""
    if len(secret) < SECRET_PIECE:
        return text.replace(secret, "<token>") if secret else text
    pieces = {secret[start : start + SECRET_PIECE] for start in range(len(secret) - SECRET_PIECE + 1)}
    hidden = [False] * len(text)
    for start in range(len(text) - SECRET_PIECE + 1):
        if text[start : start + SECRET_PIECE] in pieces:
            hidden[start : start + SECRET_PIECE] = [True] * SECRET_PIECE
    shown, previous = [], False
    for char, hide in zip(text, hidden, strict=True):
        if not hide:
            shown.append(char)
        elif not previous:
            shown.append("<token>")
        previous = hide
    return "".join(shown)


@contextlib.contextmanager
def _one_line_push_errors(repo_id: str, token: str):
    """A network, authentication or permission failure of a Hub call becomes one `HubPushError` line, without the
    token."""
    try:
        yield
    except Exception as error:
        message = without_secret(" ".join(str(error).split()), token) or type(error).__name__
        raise HubPushError(
            f"pushing to {repo_id} failed ({type(error).__name__}): {message[:300]}. Check the network, that the "
            "token has write access to the repository, and try again."
        ) from None
