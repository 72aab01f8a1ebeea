"""The chart's alert rules, checked and unit-tested by the real, pinned promtool.

No cluster is needed: promtool reads ``charts/sessionfleet/rules/`` as plain files
(``promtool check rules``, and ``promtool test rules`` with the unit tests next to the
rules), and the PrometheusRule that ``helm template`` renders from them is checked the
same way. promtool and helm come from ``make e2e-tools``: without them these tests
fail, they do not skip. The metric names the rules use are checked against the code
in tests/test_monitoring.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart import CHART, by_kind, render
from e2e.localcluster import ToolsMissingError, find_tools

pytestmark = pytest.mark.timeout(120)

RULES_DIR = CHART / "rules"
RULES = RULES_DIR / "sessionfleet.rules.yaml"
UNIT_TESTS = RULES_DIR / "sessionfleet.rules.test.yaml"
DEFAULT_JOB = 'job="sessionfleet-operator-metrics"'


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess[str]:
    """Run the pinned promtool; fails the test (never skips) when it is not built."""
    try:
        binary = find_tools().promtool
    except ToolsMissingError as error:
        pytest.fail(f"{error}\nThe rule tests need the pinned promtool: run `make e2e-tools`.")
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def file_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_is_the_pinned_release() -> None:
    result = promtool("--version")
    assert result.returncode == 0, result.stderr
    assert re.match(r"promtool, version 3\.16\.0 ", result.stdout), result.stdout


def test_promtool_checks_the_rule_file() -> None:
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(file_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", UNIT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_unit_tests_fire_and_silence_every_alert() -> None:
    """Each alert has an evaluation where it fires, and one after its `for` where it is silent."""
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fired: set[str] = set()
    silent: set[str] = set()
    holds = {rule["alert"]: _minutes(rule["for"]) for rule in file_rules()}
    for group in tests["tests"]:
        for case in group["alert_rule_test"]:
            name = case["alertname"]
            if case["exp_alerts"]:
                fired.add(name)
            elif _minutes(case["eval_time"]) >= holds[name]:
                silent.add(name)
    assert fired == set(holds), f"alerts never seen firing: {sorted(set(holds) - fired)}"
    assert silent == set(holds), f"alerts never seen silent: {sorted(set(holds) - silent)}"


def _minutes(duration: str) -> int:
    match = re.fullmatch(r"(\d+)m", duration)
    assert match, f"write durations in minutes in the rules and their tests: {duration!r}"
    return int(match[1])


def _rendered_rule_file(tmp_path: Path, *sets: str, **options: Any) -> tuple[Path, list[dict]]:
    objects = render("prometheusRule.enabled=true", *sets, **options)
    (rule,) = by_kind(objects, "PrometheusRule").values()
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path, [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_the_rendered_rules_are_the_file_with_the_release_job(tmp_path: Path) -> None:
    path, rendered = _rendered_rule_file(tmp_path, release="sessionfleet", namespace="ops")
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    job = 'job="sessionfleet-operator-metrics", namespace="ops"'
    expected = [{**rule, "expr": rule["expr"].replace(DEFAULT_JOB, job)} for rule in file_rules()]
    assert rendered == expected


def test_the_rendered_rules_take_the_values(tmp_path: Path) -> None:
    alerts = {
        "SessionfleetPrefixCacheHitRateLow": {"threshold": 0.85, "for": "30m"},
        "SessionfleetOperatorNotReconciling": {"threshold": 900, "severity": "page"},
        "SessionfleetCheckpointFailing": {"threshold": 2},
        "SessionfleetSessionsPending": {"enabled": False},
    }
    path, rendered = _rendered_rule_file(
        tmp_path,
        "prometheusRule.operatorJob=my-operator",
        "prometheusRule.runbookBaseURL=https://wiki.example.com/sessionfleet",
        values={"prometheusRule": {"alerts": alerts, "additionalRuleLabels": {"team": "gpu"}}},
    )
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    by_name = {rule["alert"]: rule for rule in rendered}
    assert "SessionfleetSessionsPending" not in by_name
    assert len(by_name) == len(file_rules()) - 1
    hit = by_name["SessionfleetPrefixCacheHitRateLow"]
    assert hit["expr"].endswith("< 0.85") and hit["for"] == "30m"
    stuck = by_name["SessionfleetOperatorNotReconciling"]
    assert stuck["expr"].endswith("> 900")
    assert 'job="my-operator", namespace="sf"' in stuck["expr"]
    assert stuck["labels"] == {"severity": "page", "team": "gpu"}
    assert by_name["SessionfleetCheckpointFailing"]["expr"].endswith("> 2")
    for rule in rendered:
        assert DEFAULT_JOB not in rule["expr"], rule["alert"]
        assert rule["annotations"]["runbook_url"] == (
            f"https://wiki.example.com/sessionfleet#{rule['alert'].lower()}"
        )
