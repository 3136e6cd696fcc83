"""Stand-in for transformers' `tests/generation/test_utils.py`, which the sdist does not ship.

`ModelTesterMixin` only checks that a tester of a model that can `generate` inherits `GenerationTesterMixin`
(`test_generation_tester_mixin_inheritance`). The stand-in adds no tests: damcha-hf tests generation with its own
tests of the same contract (`tests/test_contract.py`: greedy generation with a dynamic, a static and no cache for every
variant, incremental logits against the full forward, compiled static-cache generation, cross-attention caches).
"""


class GenerationTesterMixin:
    """Marks a tester whose model classes can `generate`; the generation tests themselves live in test_contract.py."""
