"""Stand-in for transformers' `tests/generation/test_utils.py`, which the sdist does not ship.

`ModelTesterMixin` only checks that a tester of a model that can `generate` inherits `GenerationTesterMixin`
(`test_generation_tester_mixin_inheritance`). The stand-in adds no tests: damcha-hf tests generation with its own
tests of the same contract (`tests/test_families.py`: generation with a dynamic, a static and no cache against one
full forward, in every causal family and context, and left-padded batches; `tests/test_contract.py`: the same for
every baseline variant, incremental logits, compiled static-cache generation, cross-attention caches).
"""


class GenerationTesterMixin:
    """Marks a tester whose model classes can `generate`; the generation tests live in test_families.py and
    test_contract.py."""
