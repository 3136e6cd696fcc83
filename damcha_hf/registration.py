"""Registration of the DAMCHA configs and models with the transformers Auto classes, from the family declarations.

`import damcha_hf` must leave the Auto classes able to resolve every DAMCHA type, yet import neither torch nor
transformers (the command line's `--help` answers at once). So registration follows transformers' own loading: the
DAMCHA configs are registered right after transformers imports its `AutoConfig` module, and the models right after it
imports its `AutoModel...` module (at once, for a module already imported). A process that never uses the Auto
classes pays nothing; one that does finds the DAMCHA types there, with no `trust_remote_code`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import pkgutil
import sys
from collections.abc import Callable

CONFIG_AUTO_MODULE = "transformers.models.auto.configuration_auto"
MODEL_AUTO_MODULE = "transformers.models.auto.modeling_auto"
# The torch-free configuration modules of `damcha_hf.modeling`, named as transformers names its own.
CONFIG_MODULE_PREFIX = "configuration_damcha_"


def damcha_config_classes() -> list[type]:
    """Every DAMCHA config class, from the `configuration_damcha_*` modules (which import no torch)."""
    from . import modeling

    classes = []
    for module_info in sorted(pkgutil.iter_modules(modeling.__path__), key=lambda info: info.name):
        if not module_info.name.startswith(CONFIG_MODULE_PREFIX):
            continue
        module = importlib.import_module(f"{modeling.__name__}.{module_info.name}")
        classes += [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and value.__module__ == module.__name__
            and str(getattr(value, "model_type", "")).startswith("damcha_")
        ]
    return classes


def auto_class_table() -> list[tuple[type, list[tuple[type, type]]]]:
    """(config class, [(auto class, model class), ...]) for every DAMCHA architecture, as the Hub export reads it."""
    import transformers

    from .families import FAMILIES, NATIVE_FAMILIES

    return [
        (
            family.config_class,
            [(getattr(transformers, head.auto_class), head.model_class) for head in family.heads if head.auto_class],
        )
        for family in (*FAMILIES, *NATIVE_FAMILIES)
    ]


def __getattr__(name: str):
    if name == "AUTO_CLASS_TABLE":  # built on use: it imports the model classes, and so torch
        return auto_class_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_configs() -> None:
    """`AutoConfig` resolves every DAMCHA `model_type`, and saved configs carry `auto_map` (remote code)."""
    from transformers import AutoConfig

    for config_class in damcha_config_classes():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()


def register_models() -> None:
    """Every `AutoModel...` class resolves its DAMCHA models, and `save_pretrained` writes `auto_map` and copies the
    model files, so a checkpoint loads with `trust_remote_code=True` where this package is not installed."""
    for config_class, model_classes in auto_class_table():
        for auto_class, model_class in model_classes:
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)


class _LoaderThenReport(importlib.abc.Loader):
    """A module's own loader, reporting to `watcher` once the module has run."""

    def __init__(self, loader, watcher: _RegisterAfterImport):
        self.loader, self.watcher = loader, watcher

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.watcher.module_done(module.__name__)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the module's own loader answers
        return getattr(self.loader, name)


# Modules whose imports the watcher follows: registering imports transformers' model modules and this package's own
# model files, either of which may be the import in progress when the Auto module finishes loading.
_WATCHED_PREFIXES = ("transformers.", "damcha_hf.")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """On `sys.meta_path` until every registration has run: each function in `pending[module]` runs once `module`
    has been imported and no transformers or damcha_hf module is still being imported (registering imports
    transformers' model modules and the DAMCHA model files, which would otherwise be met half-initialised: e.g.
    `damcha_hf.DamchaGPT2LMHeadModel` first imports `modeling_damcha_gpt2`, which imports transformers' GPT-2 and,
    through it, the Auto module)."""

    def __init__(self):
        self.pending: dict[str, list[Callable[[], None]]] = {}
        self.ready: list[Callable[[], None]] = []
        self.running = False

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(_WATCHED_PREFIXES) or not (self.pending or self.ready):
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThenReport(spec.loader, self)
                return spec
        return None

    def module_done(self, name: str) -> None:
        self.ready += self.pending.pop(name, [])
        if self.running or not self.ready or _transformers_importing(besides=name):
            return
        self.running = True
        try:
            while self.ready:
                self.ready.pop(0)()
        finally:
            self.running = False
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def _transformers_importing(besides: str) -> bool:
    """Whether a transformers or damcha_hf module other than `besides` is still running its import (`damcha_hf`
    itself registers at the end of its own import, so it does not count)."""
    return any(
        name.startswith(_WATCHED_PREFIXES)
        and name != besides
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


_AFTER_IMPORT = _RegisterAfterImport()


def install_auto_class_registration() -> None:
    """Register the configs once transformers' `AutoConfig` module is imported and the models once its
    `AutoModel...` module is (now, for a module already imported). Imports nothing heavy itself."""
    for module_name, register in ((CONFIG_AUTO_MODULE, register_configs), (MODEL_AUTO_MODULE, register_models)):
        if module_name in sys.modules:
            register()
        elif register not in _AFTER_IMPORT.pending.get(module_name, []):
            _AFTER_IMPORT.pending.setdefault(module_name, []).append(register)
    if _AFTER_IMPORT.pending and _AFTER_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_IMPORT)
