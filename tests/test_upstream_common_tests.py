"""Taking transformers' common tests from its sdist (`upstream_common_tests.py`), on a small sdist built here."""

import io
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import upstream_common_tests
from upstream_common_tests import CommonTestsUnavailable, extract_common_tests, fetch_common_tests

MODELING = b"""from .generation.test_utils import GenerationTesterMixin
from .exporters.test_export import ExportTesterMixin
from .helpers.shapes import batch_size


class ModelTesterMixin(ExportTesterMixin):
    pass
"""
CONFIGURATION = b"from .utils.test_configuration_utils import config_common_kwargs\n"
SHAPES = b"from ..test_modeling_common import ModelTesterMixin\nfrom . import sizes\nbatch_size = 2\n"
SIZES = b"width = 8\n"


def write_sdist(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as archive:
        for name, data in {"transformers-9.9.0/setup.py": b"", **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_extracts_the_entry_modules_and_what_they_import_and_names_what_is_missing(tmp_path):
    sdist = tmp_path / "transformers-9.9.0.tar.gz"
    write_sdist(sdist, {
        "transformers-9.9.0/tests/test_modeling_common.py": MODELING,
        "transformers-9.9.0/tests/test_configuration_common.py": CONFIGURATION,
        "transformers-9.9.0/tests/helpers/shapes.py": SHAPES,
        "transformers-9.9.0/tests/helpers/sizes.py": SIZES,
        "transformers-9.9.0/tests/test_tokenization_common.py": b"raise ImportError\n",  # not imported: left out
    })  # fmt: skip
    missing = extract_common_tests(sdist, tmp_path / "tests")
    assert missing == ["exporters.test_export", "generation.test_utils", "utils.test_configuration_utils"]
    extracted = {str(path.relative_to(tmp_path / "tests")) for path in (tmp_path / "tests").rglob("*.py")}
    assert extracted == {"__init__.py", "test_modeling_common.py", "test_configuration_common.py",
                         "helpers/__init__.py", "helpers/shapes.py", "helpers/sizes.py"}  # fmt: skip
    assert (tmp_path / "tests" / "helpers" / "shapes.py").read_bytes() == SHAPES


def test_every_module_the_sdists_lack_has_a_stand_in_of_that_name():
    """The modules real sdists (5.23 to 5.25) lack; each stand-in is a module of ours under that name."""
    for module in ("exporters.test_export", "generation.test_utils", "utils.test_configuration_utils"):
        assert (upstream_common_tests.STAND_INS / (module.replace(".", "/") + ".py")).is_file()


def test_a_failed_download_raises_unavailable_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # No package index and no configuration: pip finds no sdist, as without network.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    (tmp_path / "no-links").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    with pytest.raises(CommonTestsUnavailable, match="pip download"):
        fetch_common_tests("5.25.0")
    cache = tmp_path / "cache" / "damcha-hf" / "transformers-tests"
    assert list(cache.iterdir()) == []


def test_the_cache_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert upstream_common_tests.cache_dir("5.25.0") == tmp_path / "damcha-hf" / "transformers-tests" / "5.25.0"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        upstream_common_tests.cache_dir("5.25.0")
        == tmp_path / "home" / ".cache" / "damcha-hf" / "transformers-tests" / "5.25.0"
    )


def test_a_complete_cache_is_used_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = upstream_common_tests.cache_dir("9.9.0")
    cached.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))  # a download attempt would fail
    assert fetch_common_tests("9.9.0") == cached


@pytest.mark.parametrize(
    "markexpr, collected",
    [("not slow and not common", False), ("slow and not common", False), ("common", True), ("", True),
     ("slow or common", True), ("not slow", True)],
)  # fmt: skip
def test_the_common_tests_file_is_collected_only_where_the_selection_can_pick_it(markexpr, collected):
    """Collecting test_common_models.py downloads transformers' sdist: a selection without `common` must not."""
    import conftest

    config = SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))
    ignored = conftest.pytest_ignore_collect(Path(conftest.__file__).with_name(conftest.COMMON_TESTS_FILE), config)
    assert (ignored is None) == collected
    assert conftest.pytest_ignore_collect(Path(conftest.__file__).with_name("test_gpt2.py"), config) is None
