"""transformers' common model tests, run against the DAMCHA classes by `tests/test_common_models.py`.

`test_modeling_common.py` (`ModelTesterMixin`) and `test_configuration_common.py` (`ConfigTester`) are vendored
unchanged from the transformers 5.24.0 sdist (`pip download transformers==5.24.0 --no-binary :all: --no-deps`),
Apache-2.0 like this project, so that the run needs no network. The same files run against both ends of the supported
range (5.23 and 5.24); where a 5.24 expectation does not hold on 5.23, `tests/test_common_models.py` skips that test
on 5.23 and says why. To refresh them for a new transformers release, copy the two files from its sdist over these.

The sdist does not ship three modules they import; `generation/test_utils.py`, `exporters/test_export.py` and
`utils/test_configuration_utils.py` here are minimal stand-ins of our own (their docstrings say what each keeps).
`conftest.py` keeps pytest from collecting this folder: its files are imported, not run.
"""
