# The vendored files define mixins, not tests: `tests/test_common_models.py` runs them against the DAMCHA classes.
collect_ignore_glob = ["*.py"]
