"""The transformers releases the package claims, CI tests and setup.cfg admits are one list.

`TESTED_TRANSFORMERS` (modeling/damcha_config.py) is the list; `.ci/run` must test exactly those releases, and
setup.cfg's range must span exactly them: from the oldest release itself to just below the minor version after the
newest. Minor versions between two listed releases may go untested (CI's time allows only some), but at most one
release per minor version is listed, in ascending order, all of one major version.
"""

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from damcha_hf.modeling.damcha_config import TESTED_TRANSFORMERS

REPO = Path(__file__).resolve().parents[1]


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


def list_problems(tested: list[str]) -> list[str]:
    """What is wrong with a list of tested releases (empty when nothing is)."""
    if not tested:
        return ["no release listed"]
    versions = [Version(version) for version in tested]
    problems = []
    if any(version.pre or version.dev or version.post or version.local for version in versions):
        problems.append("a listed release is not a plain final release")
    if versions != sorted(versions):
        problems.append("releases not in ascending order")
    minors = [(version.major, version.minor) for version in versions]
    if len(set(minors)) != len(minors):
        problems.append("more than one release of a minor version")
    if len({major for major, _ in minors}) != 1:
        problems.append("releases of more than one major version")
    return problems


def range_problems(tested: list[str], specifier: SpecifierSet) -> list[str]:
    """What is wrong with setup.cfg's `specifier` for the list `tested` (empty when nothing is): it must be exactly
    `>=oldest,<major.(newest minor + 1)`."""
    oldest, newest = Version(tested[0]), Version(tested[-1])
    expected = SpecifierSet(f">={oldest},<{newest.major}.{newest.minor + 1}")
    problems = [] if specifier == expected else [f"setup.cfg says transformers{specifier}, the list spans {expected}"]
    problems += [f"{version} is outside {specifier}" for version in tested if Version(version) not in specifier]
    return problems


def test_tested_releases_are_ascending_and_one_per_minor_version():
    assert list_problems(list(TESTED_TRANSFORMERS)) == []


def test_setup_cfg_spans_exactly_the_tested_releases():
    assert range_problems(list(TESTED_TRANSFORMERS), transformers_requirement().specifier) == []


def test_ci_runs_exactly_the_tested_releases():
    listed = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--versions"], capture_output=True, text=True,
                            check=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert listed.stdout.split() == list(TESTED_TRANSFORMERS)


@pytest.mark.parametrize(
    "tested, problem",
    [
        ([], "no release listed"),
        (["5.19.0", "5.16.1"], "ascending"),
        (["5.16.0", "5.16.1"], "more than one release of a minor version"),
        (["4.57.1", "5.16.1"], "more than one major version"),
        (["5.16.1", "5.25.0rc1"], "not a plain final release"),
    ],
)
def test_the_list_rule_fails_on_a_bad_list(tested, problem):
    assert any(problem in found for found in list_problems(tested))


@pytest.mark.parametrize(
    "specifier",
    [
        ">=5.16,<5.26",  # admits 5.16.0, below the oldest tested release
        ">=5.16.1,<5.25",  # leaves out the newest tested release
        ">=5.16.1,<5.27",  # admits a minor version after the newest tested one
        ">=5.19,<5.26",  # leaves out the oldest tested release
        ">=5.16.1",  # no upper bound
    ],
)
def test_the_range_rule_fails_on_a_range_other_than_the_lists_span(specifier):
    assert range_problems(["5.16.1", "5.19.0", "5.22.2", "5.25.0"], SpecifierSet(specifier))


def test_the_range_rule_allows_untested_minor_versions_between_listed_ones():
    assert range_problems(["5.16.1", "5.19.0", "5.25.0"], SpecifierSet(">=5.16.1,<5.26")) == []
