"""What ``make demo`` suggests trying once it is up: commands for the demo's namespace."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo.run import NAMESPACE, suggestions  # noqa: E402

DATA = {
    "kubeconfig": "/state/cluster/kubeconfig",
    "router": "http://127.0.0.1:8080",
    "operator_metrics": "http://127.0.0.1:8081/metrics",
    "agent_metrics": "http://127.0.0.1:9400/metrics",
}


def commands() -> list[list[str]]:
    text = suggestions(DATA, [Path("/venv/bin"), Path("/tools/bin"), Path("/venv/bin")])
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.startswith("  ")]


def test_the_environment_comes_first() -> None:
    assert commands()[:2] == [
        ["export", "KUBECONFIG=/state/cluster/kubeconfig"],
        ["export", "PATH=/venv/bin:/tools/bin:$PATH"],  # each directory once
    ]


def test_the_plugin_and_the_events_are_suggested_for_the_demos_namespace() -> None:
    kubectl = [c[1:] for c in commands() if c[0] == "kubectl"]
    assert ["sessionfleet", "status", "-n", NAMESPACE] in kubectl
    assert ["-n", NAMESPACE, "events"] in kubectl
    assert ["-n", NAMESPACE, "events", "--for", "inferenceworker/w-1"] in kubectl
    # Every kubectl command names the namespace; a plugin's flags follow its name.
    for argv in kubectl:
        assert NAMESPACE in argv, argv
        if argv[0] == "sessionfleet":
            assert argv.index("-n") > 0


def test_the_endpoints_are_the_demos() -> None:
    curls = [c for c in commands() if c[0] == "curl"]
    assert {c[2] for c in curls} == {
        "http://127.0.0.1:8080/v1/chat/completions",
        "http://127.0.0.1:8080/metrics",
        "http://127.0.0.1:8081/metrics",
        "http://127.0.0.1:9400/metrics",
    }
