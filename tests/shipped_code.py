"""The model code a saved checkpoint must carry, derived from the import graph of `modeling/` (transformers' own parser
of relative imports, what `trust_remote_code=True` follows), independently of how the save reduces it."""

from pathlib import Path

from transformers.dynamic_module_utils import get_relative_imports

import damcha_hf
from damcha_hf.modeling.variants import VARIANTS

MODELING = Path(damcha_hf.modeling.__file__).parent
REGISTRY = "variants"


def variant_module(name: str) -> str:
    """The `variant_*` module that declares variant `name`."""
    return type(VARIANTS[name]).__module__.rpartition(".")[2]


def expected_code(entry_modules, variant: str | None) -> set[str]:
    """The files a checkpoint of `variant` needs: what `entry_modules` import, transitively, where the registry imports
    only `variant`'s declaration and plain attention's (None: every variant's, as the plugin's own registry does)."""
    every_variant = {variant_module(name) for name in VARIANTS}
    kept_variants = every_variant if variant is None else {variant_module(variant), variant_module("none")}
    found, pending = set(), list(entry_modules)
    while pending:
        module = pending.pop()
        if module in found:
            continue
        found.add(module)
        imports = get_relative_imports(MODELING / f"{module}.py")
        if module == REGISTRY:
            imports = [name for name in imports if name not in every_variant - kept_variants]
        pending += imports
    return {f"{module}.py" for module in found}
