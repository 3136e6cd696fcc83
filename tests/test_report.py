"""The built report: every generated region of the committed pages is what experiments/report.py makes of the JSON
now, and its words follow the rules (ahead/behind only for an interval that excludes zero), checked against
closed-form intervals and against the intervals the generated text itself quotes."""

import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPOSITORY)

from experiments import common, report  # noqa: E402

T_975_2DF = 4.302652729749462  # Student's t, 97.5% point, 2 degrees of freedom


def test_committed_pages_are_what_the_script_generates():
    """Fails when a committed page's generated region differs from the JSON (run python experiments/report.py)."""
    assert report.stale() == []


def test_a_region_is_rewritten_and_the_hand_text_around_it_stays(tmp_path):
    page = tmp_path / "page.md"
    hand_before, hand_after = "# Title\n\nWritten by hand: DAMCHA is level.\n\n", "\nMore hand text.\n"
    page.write_text(hand_before + report.BEGIN.format(name="n") + "\nold figure\n" + report.END + hand_after)
    regions = {"page.md": {"n": lambda base: "new figure from " + base}}
    assert report.stale(regions, str(tmp_path)) == ["page.md"]
    (text, generated) = report.pages(regions, str(tmp_path))["page.md"]
    assert (
        generated
        == hand_before + report.BEGIN.format(name="n") + "\nnew figure from page.md\n" + report.END + hand_after
    )
    page.write_text(generated)
    assert report.stale(regions, str(tmp_path)) == []
    # a region the page marks but the script does not know, and a region the page lacks, are errors naming it
    page.write_text(generated + report.BEGIN.format(name="x") + "\n" + report.END + "\n")
    with pytest.raises(SystemExit, match="region 'x' that report.py does not generate"):
        report.pages(regions, str(tmp_path))
    with pytest.raises(SystemExit, match="lacks the markers of other"):
        report.pages({"page.md": {"n": lambda base: "", "other": lambda base: ""}}, str(tmp_path))


def test_wording_rules_against_closed_form_intervals():
    """Oracle: differences (1, 2, 3) have mean 2, standard deviation 1, standard error 1/sqrt(3) and the 95% interval
    2 ± 4.3027/sqrt(3) = [-0.484, +4.484], containing zero; (1.9, 2.0, 2.1) give 2 ± 0.43027/sqrt(3) = [+1.752,
    +2.248], excluding it."""
    wide = common.paired_statistics([1.0, 2.0, 3.0])
    assert wide["low"] == pytest.approx(2 - T_975_2DF / math.sqrt(3)) and wide["high"] == pytest.approx(
        2 + T_975_2DF / math.sqrt(3)
    )
    narrow = common.paired_statistics([1.9, 2.0, 2.1])
    assert narrow["low"] == pytest.approx(2 - 0.1 * T_975_2DF / math.sqrt(3))
    assert not common.is_resolved(wide) and common.is_resolved(narrow)
    assert (
        common.difference_sentence("A", "B", wide, lower_is_better=True)
        == "A − B: no difference resolved, +2.000 [-0.484, +4.484] (3/3)"
    )
    # lower is better (bits per byte): a positive resolved difference is behind; higher is better (top-1): ahead
    assert (
        common.difference_sentence("A", "B", narrow, lower_is_better=True)
        == "A is behind B: +2.000 [+1.752, +2.248] (3/3)"
    )
    assert (
        common.difference_sentence("A", "B", narrow, lower_is_better=False, scale=100, digits=1, unit="points")
        == "A is ahead of B: +200.0 [+175.2, +224.8] (3/3) points"
    )
    negative = common.paired_statistics([-1.9, -2.0, -2.1])
    assert common.direction(negative, lower_is_better=True) == "ahead"
    assert common.direction(negative, lower_is_better=False) == "behind"
    assert (
        common.verdict_cell(wide, True) == "no difference resolved"
        and common.verdict_cell(narrow, True) == "**behind**"
    )
    # Holm stated where applied: the adjusted p-value and whether it stays under 5%
    assert common.difference_sentence("A", "B", {**narrow, "p_holm": 0.048}, lower_is_better=True, holm=True).endswith(
        "; Holm p 0.048, kept"
    )
    assert common.holm_clause({"p_holm": 0.097}) == "; Holm p 0.097, not kept" and common.holm_clause({}) == ""
    # one seed has no interval: never resolved
    assert not common.is_resolved(common.paired_statistics([0.5]))


CLAUSE = re.compile(r"is (ahead of|behind) [^:]+: ([+-]\d+\.\d+) \[([+-]\d+\.\d+), ([+-]\d+\.\d+)\]")
UNRESOLVED = re.compile(r"no difference resolved, ([+-]\d+\.\d+) \[([+-]\d+\.\d+), ([+-]\d+\.\d+)\]")


def generated_bodies():
    for page, (text, _) in report.pages().items():
        for match in report.REGION.finditer(text):
            yield page, match["name"], match["body"]


def test_every_generated_clause_agrees_with_the_interval_it_quotes():
    """Oracle: the interval printed beside each word. "ahead"/"behind" only beside an interval that excludes zero,
    "no difference resolved" only beside one that contains it; none of the words that read as a result without one."""
    clauses = 0
    for page, name, body in generated_bodies():
        flat = " ".join(line.strip() for line in body.splitlines())
        for word, mean, low, high in CLAUSE.findall(flat):
            assert float(low) > 0 or float(high) < 0, (page, name, word, low, high)
            assert float(low) <= float(mean) <= float(high)
            clauses += 1
        for mean, low, high in UNRESOLVED.findall(flat):
            assert float(low) <= 0 <= float(high) and float(low) <= float(mean) <= float(high), (page, name, low, high)
            clauses += 1
        for word in common.FORBIDDEN_FOR_UNRESOLVED:
            assert not re.search(rf"\b{word}\b", flat), (page, name, word)
    assert clauses > 50


def test_generated_verdicts_match_the_json_they_name():
    """Recomputed from the per-seed values in the JSON: the ViT DAMCHA "token" − MHA difference at either pass's MHA
    rate (paired by seed across the two files), and Holm's p over both passes' test comparisons."""
    final = report.read(report.FINAL["vit"])
    earlier = report.read(report.EARLIER["vit"])

    def by_seed(data, row):
        return {r["seed"]: r["test_top1"] for r in data["results"]["vit"][row]}

    token, mha_other = by_seed(final, "DAMCHA token"), by_seed(earlier, "MHA")
    differences = np.array([token[s] - mha_other[s] for s in sorted(token)])
    mean, se = differences.mean(), differences.std(ddof=1) / math.sqrt(len(differences))
    from scipy.stats import t

    half = t.ppf(0.975, len(differences) - 1) * se
    expected = f"+{100 * mean:.2f} [{100 * (mean - half):+.2f}, {100 * (mean + half):+.2f}]"
    verdict = report.tuned_verdict("docs/results.md")
    assert f'DAMCHA `"token"` − MHA at 0.002: no difference resolved, {expected}' in verdict
    # Holm over both files' test comparisons, by hand: sort the p-values, multiply by m - rank, running maximum
    family = [c for source in (final, earlier) for c in source["comparisons"]["vit"] if c["metric"] == "test_top1"]
    p_values = sorted(c["p_value"] for c in family)
    target = next(c["p_value"] for c in final["comparisons"]["vit"]
                  if (c["row"], c["reference"], c["metric"]) == ("DAMCHA token", "MHA", "test_top1"))  # fmt: skip
    rank = p_values.index(target)
    holm = max(min(1.0, (len(p_values) - i) * p_values[i]) for i in range(rank + 1))
    assert f'Holm\'s p of DAMCHA `"token"` − MHA at 0.0005 is {holm:.3f}' in verdict


def test_rounds_for_a_95_percent_interval_of_a_median():
    """Closed form: [min, max] of n rounds misses the median with probability 2^(1-n); 5 rounds cover 93.75%, 6 cover
    96.9%. A simulation of 3 rounds of a skewed distribution covers its median about 75% of the time."""
    assert common.rounds_for_interval(0.95) == 6 and common.rounds_for_interval(0.75) == 3
    assert common.rounds_for_interval(0.9375) == 5
    rng = np.random.default_rng(0)
    samples = rng.exponential(size=(20000, 3))
    covered = ((samples.min(axis=1) <= math.log(2)) & (samples.max(axis=1) >= math.log(2))).mean()
    assert covered == pytest.approx(0.75, abs=0.01)
    assert "75% probability, not 95%; 6 rounds" in common.too_few_rounds_sentence(3)


def write_run(folder, task, rate, seed, values, name=None):
    """A tuning run's JSON as quality.py writes it: per row, one record of the seed with its validation and test."""
    test, validation = report.TASKS[task][:2]
    results = {task: {row: [{"seed": seed, "lr": rate, validation: v, test: v + 0.1}] for row, v in values.items()}}
    payload = {"finished": True, "machine": "CPU test, 1 torch threads", "torch": "2.13.0+cpu",
               "args": {f"{task}_lr": rate, "seeds": [seed], "threads": 1}, "results": results}  # fmt: skip
    (folder / (name or f"{task}_lr{rate:g}_seed{seed}.json")).write_text(json.dumps(payload))


def test_learning_rate_curves_are_the_mean_and_standard_error_over_seeds(tmp_path):
    """Oracle: numpy's mean and sample standard deviation / sqrt(n) of the values written per rate and seed; a rerun
    kept beside a run under another name does not replace it; the figure is written."""
    values = {
        (0.001, 10): 2.0,
        (0.001, 11): 2.2,
        (0.001, 12): 2.7,
        (0.002, 10): 1.9,
        (0.002, 11): 2.1,
        (0.002, 12): 2.0,
    }
    for (rate, seed), v in values.items():
        write_run(tmp_path, "lm", rate, seed, {"MHA": v, "DCMHA": v - 0.05})
    write_run(tmp_path, "lm", 0.001, 10, {"MHA": 9.0, "DCMHA": 9.0}, name="lm_lr0.001_seed10_run2.json")
    curves = report.learning_rate_curves(str(tmp_path))["lm"]
    assert curves["MHA"]["rates"] == [0.001, 0.002]
    for index, rate in enumerate((0.001, 0.002)):
        seeds = np.array([values[(rate, s)] for s in (10, 11, 12)])
        assert curves["MHA"]["validation_bpb"]["mean"][index] == pytest.approx(seeds.mean())
        assert curves["MHA"]["validation_bpb"]["se"][index] == pytest.approx(seeds.std(ddof=1) / math.sqrt(3))
        assert curves["DCMHA"]["test_bpb"]["mean"][index] == pytest.approx(seeds.mean() - 0.05 + 0.1)
        assert curves["MHA"]["validation_bpb"]["n"][index] == 3
    table = report.tuning_table(str(tmp_path), "lm")
    assert "| 0.002         | 2.000 (best) | 1.950 (best) |" in table
    (path,) = report.plot_learning_rate_curves(str(tmp_path))
    assert os.path.basename(path) == "lm_learning_rate_curves.png" and os.path.getsize(path) > 1000


def test_the_equal_budget_section_is_built_from_its_runs_with_holm_over_both_tasks(tmp_path):
    """Tiny paired runs of both tasks stand in for the 8-seed comparison: the section has each task's table and
    sentences, and Holm's correction over the union of both tasks' test comparisons (oracle: its count, and the
    adjusted p-values recomputed from the files' p-values by hand)."""
    from experiments import quality

    files = {}
    for task, rows in (("lm", ["MHA", "DAMCHA token", "DCMHA"]), ("vit", ["MHA", "DAMCHA sequence", "DCMHA"])):
        out = tmp_path / task
        quality.main(["--tiny", "--synthetic", "--tasks", task, "--seeds", "0", "1", "2", "--threads", "1",
                      "--no-plots", "--rows", *rows, "--out-dir", str(out), "--prefix", "run"])  # fmt: skip
        files[task] = str(out / "run.json")
    missing = report.equal_budget("README.md", str(tmp_path), {"lm": str(tmp_path / "none.json")})
    assert missing.startswith("Not run yet") and "none.json" in missing
    text = report.equal_budget("README.md", str(tmp_path), files)
    assert text.count("| DCMHA ") == 2
    assert 'DAMCHA `"sequence"` − DCMHA' in text or 'DAMCHA `"sequence"` is' in text
    family = [c for task, path in files.items() for c in json.loads(Path(path).read_text())["comparisons"][task]
              if c["metric"] == report.TASKS[task][0]]  # fmt: skip
    assert len(family) == 2 * 3  # per task: two rows against MHA, DAMCHA against DCMHA
    assert f"Both tasks as one family ({len(family)} test comparisons" in text
    p_values = sorted(c["p_value"] for c in family)
    adjusted = [max(min(1.0, (len(p_values) - i) * p_values[i]) for i in range(k + 1)) for k in range(len(p_values))]
    kept = sum(1 for p in adjusted if p < 0.05)
    tail = " ".join(text.split("kept by Holm: ")[1].split())
    assert (tail == "none.") == (kept == 0) and tail.count("Holm p") == kept


def test_statistics_recomputed_from_the_records_match_the_stored_ones():
    """A file written with p-values: recomputing its comparisons from the per-seed records (what the tables of older
    files rest on) gives the stored numbers back."""
    stored = report.read(report.FINAL["lm"])["comparisons"]["lm"]
    recomputed = report.with_statistics(report.FINAL["lm"])["comparisons"]["lm"]
    assert [(c["row"], c["reference"], c["metric"]) for c in recomputed] == [
        (c["row"], c["reference"], c["metric"]) for c in stored
    ]
    for mine, theirs in zip(recomputed, stored):
        for key in ("mean", "low", "high", "p_value", "p_holm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12, abs=1e-15)
