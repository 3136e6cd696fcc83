"""The transformers releases the package claims, CI tests and setup.cfg admits are one list.

`TESTED_TRANSFORMERS` (modeling/damcha_config.py) is the list; `.ci/run` must test exactly those releases, and
setup.cfg's range must admit exactly their minor versions: from the oldest to just below the minor version after the
newest, with no minor version in between left untested.
"""

import configparser
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from damcha_hf.modeling.damcha_config import TESTED_TRANSFORMERS

REPO = Path(__file__).resolve().parents[1]
TESTED = [Version(version) for version in TESTED_TRANSFORMERS]


def transformers_requirement() -> Requirement:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines()]
    (requirement,) = [
        Requirement(line)
        for line in lines
        if line and not line.startswith("#") and Requirement(line).name == "transformers"
    ]
    return requirement


def test_tested_releases_are_ascending_and_one_per_consecutive_minor_version():
    assert sorted(set(TESTED)) == TESTED and TESTED
    minors = [(version.major, version.minor) for version in TESTED]
    assert len(set(minors)) == len(minors), "one release per minor version"
    assert all(major == TESTED[0].major for major, _ in minors)
    assert [minor for _, minor in minors] == list(range(minors[0][1], minors[-1][1] + 1)), "a minor version untested"


def test_ci_runs_exactly_the_tested_releases():
    listed = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--versions"], capture_output=True, text=True,
                            check=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert listed.stdout.split() == list(TESTED_TRANSFORMERS)


def test_setup_cfg_admits_exactly_the_tested_minor_versions():
    oldest, newest = TESTED[0], TESTED[-1]
    expected = SpecifierSet(f">={oldest.major}.{oldest.minor},<{newest.major}.{newest.minor + 1}")
    assert transformers_requirement().specifier == expected
    assert all(version in expected for version in TESTED)
