"""Stand-in for transformers' `tests/exporters/test_export.py`, which the sdist does not ship.

`ModelTesterMixin` derives from `ExportTesterMixin` for its `torch.export` tests; damcha-hf does not claim
`torch.export` support, so the stand-in contributes no tests.
"""


class ExportTesterMixin:
    """Base of `ModelTesterMixin`; no export tests."""
