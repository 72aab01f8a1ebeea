"""The chart's Grafana dashboard and alert rules name only metrics the code exports.

Every PromQL expression of ``charts/sessionfleet/dashboards/sessionfleet.json`` and of
``charts/sessionfleet/rules/sessionfleet.rules.yaml`` is taken apart into the metric
names it selects, and each name is looked up in the set of sample names the components
expose, built from the code itself: the operator's metric objects
(``sessionfleet.controllers.metrics``), a router's registry (``RouterMetrics``), the
node agent's families (``sessionfleet.agent.telemetry.families``) and the vLLM names of
``sessionfleet.engines.vllm`` (typed by the simulated engine, which publishes them).
Renaming a metric in the code, or misspelling one in a panel, fails here.

The rules' own structure (annotations, runbooks, the chart's per-alert defaults) is
checked here too; ``promtool check rules`` and ``promtool test rules`` run in
``e2e/test_rules.py``, which needs the built promtool.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from sessionfleet.agent.telemetry import AgentState, GpuSample, ProcessSample, Snapshot, families
from sessionfleet.controllers import metrics as operator_metrics
from sessionfleet.engines import vllm
from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.simengine.engine import EngineCollector, EngineConfig, SimEngine

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "sessionfleet"
DASHBOARD = CHART / "dashboards" / "sessionfleet.json"
RULES = CHART / "rules" / "sessionfleet.rules.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
RUNBOOK_BASE = "https://github.com/sessionfleet/sessionfleet/blob/main/docs/runbooks.md"

#: Series Prometheus itself writes for every target; not exported by any component.
PROMETHEUS_SERIES = frozenset({"up"})

# --- what the code exports ----------------------------------------------------------------

#: The sample names of a metric family of each type, as prometheus_client's text
#: exposition writes them (``_created`` series left out: no query should need them).
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def sample_names(family_name: str, family_type: str) -> set[str]:
    """The sample names a family of this name and type is exposed with."""
    return {family_name + suffix for suffix in _SUFFIXES[family_type]}


def _collected(collector: Collector | CollectorRegistry) -> Iterator[Any]:
    yield from collector.collect()


def operator_families() -> list[Any]:
    """The operator's metric families, described by its metric objects (no samples needed)."""
    found = []
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            found += value.describe()
    return found


def router_families() -> list[Any]:
    """Every family of one router's registry, from an empty binding table."""
    return list(_collected(RouterMetrics(BindingTable()).registry))


def agent_families() -> list[Any]:
    """Every family the node agent serves."""
    return families(AgentState(node="gpu-node-0"))


def vllm_names() -> dict[str, str]:
    """The names ``sessionfleet.engines.vllm`` declares, by value, with their constant."""
    deprecated = set(vllm.DEPRECATED_METRICS)
    return {
        value: name
        for name, value in vars(vllm).items()
        if name.isupper()
        and isinstance(value, str)
        and value.startswith("vllm:")
        and value not in deprecated
    }


def vllm_families() -> list[Any]:
    """The vLLM families, typed as the simulated engine publishes them."""
    engine = EngineCollector(SimEngine(EngineConfig(model="m")))
    declared = vllm_names()
    published = [family for family in _collected(engine) if family.name in declared]
    missing = set(declared) - {family.name for family in published}
    assert not missing, f"the simulated engine does not publish {sorted(missing)}"
    return published


@cache
def exported() -> dict[str, str]:
    """Every sample name the components expose, with where it comes from."""
    sources = {
        "operator (sessionfleet.controllers.metrics)": operator_families(),
        "router (sessionfleet.fronts.metrics)": router_families(),
        "node agent (sessionfleet.agent.telemetry)": agent_families(),
        "vLLM (sessionfleet.engines.vllm)": vllm_families(),
    }
    names: dict[str, str] = dict.fromkeys(PROMETHEUS_SERIES, "Prometheus (scrape)")
    for source, found in sources.items():
        assert found, f"no metric families found in the {source}"
        for family in found:
            for name in sample_names(family.name, family.type):
                names[name] = source
    return names


# --- the metric names of a PromQL expression ----------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(
    r"(?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:[a-zA-Z]+\d*)*)"
    r"|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?"
)
#: Words of the language that are neither functions nor metric names.
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (function and aggregation names excluded).

    Strings, Grafana variables, label matchers, ranges and grouping clauses are removed
    first; what is left is names followed by ``(`` (functions and aggregations, also in
    ``sum by (x) (...)`` once the clause is gone), keywords, numbers and durations, and
    metric names.
    """
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub("0", text)
    if "__name__" in text:
        raise ValueError(f"select metrics by name, not with __name__: {expr}")
    text = _MATCHERS.sub(" ", text)
    while _RANGE.search(text):
        text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _TOKEN.finditer(text):
        name = match["name"]
        if name is None or match["call"] or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,)?\s*\w+\s*\)\s*$")


def variable_names(query: str) -> set[str]:
    """The metric names of a Grafana variable's query (``label_values(metric, label)``)."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        raise ValueError(f"a dashboard variable query this test cannot read: {query!r}")
    return metric_names(match["selector"] or "")


# --- the expressions of the dashboard and the rules ---------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for child in node.values():
            yield from _walk(child)
    elif isinstance(node, list):
        for child in node:
            yield from _walk(child)


def dashboard_queries() -> list[tuple[str, set[str]]]:
    """(where, metric names) of every query of the dashboard, its variables included."""
    board = dashboard()
    out = []
    for panel in _walk(board["panels"]):
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} query {target['refId']}: {target['expr']}"
            out.append((where, metric_names(target["expr"])))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            out.append((f"variable {variable['name']!r}: {query}", variable_names(query)))
    return out


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def rule_queries() -> list[tuple[str, set[str]]]:
    return [
        (f"alert {rule['alert']}: {rule['expr']}", metric_names(rule["expr"])) for rule in rules()
    ]


def unknown(queries: Iterable[tuple[str, set[str]]]) -> list[str]:
    """A line per query naming a metric no component exports, with the nearest names."""
    names = exported()
    problems = []
    for where, used in queries:
        for name in sorted(used - set(names)):
            near = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
            problems.append(
                f"{name} is not exported by any component (nearest: {', '.join(near) or '-'})"
                f"\n    in {where}"
            )
    return problems


# --- tests: the extraction itself ----------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum by (phase) (sessionfleet_sessions{phase="Pending"})', {"sessionfleet_sessions"}),
        (
            "histogram_quantile(0.99, sum by (le, route) "
            "(rate(sessionfleet_router_added_latency_seconds_bucket[$__rate_interval])))",
            {"sessionfleet_router_added_latency_seconds_bucket"},
        ),
        (
            "sum(rate(vllm:prefix_cache_hits_total[5m]))"
            " / sum(rate(vllm:prefix_cache_queries_total[5m]))",
            {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"},
        ),
        ('absent(up{job="a-b", namespace=~"$namespace"} == 1)', {"up"}),
        (
            "a_total offset 1h30m and on (pod) group_left (x) b unless bool c > 1e3 or d < Inf",
            {"a_total", "b", "c", "d"},
        ),
        ("sum(x) by (namespace) / ignoring (le) y[5m:30s] * -2.5e-3", {"x", "y"}),
        ('count_values("label{x}", m) > NaN', {"m"}),
        ("vector($drain_deadline) + time() - 0x1F", set()),
        ("max without (pid) (m{a='}', b=\"{\"})", {"m"}),
    ],
)
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_name_selector_is_refused() -> None:
    with pytest.raises(ValueError, match="__name__"):
        metric_names('{__name__="sessionfleet_sessions"}')


def test_variable_queries() -> None:
    assert variable_names("label_values(sessionfleet_sessions, namespace)") == {
        "sessionfleet_sessions"
    }
    assert variable_names("label_values(namespace)") == set()
    with pytest.raises(ValueError):
        variable_names("query_result(up)")


# --- tests: the exported set is the code's -------------------------------------------------


def test_exported_names_follow_the_types() -> None:
    names = exported()
    assert "sessionfleet_recoveries_total" in names  # Counter("..._total")
    assert "sessionfleet_router_requests_total" in names  # Counter("...") gains _total
    assert "sessionfleet_agent_checkpoint_operations_total" in names  # CounterMetricFamily
    assert {f"sessionfleet_bind_latency_seconds{s}" for s in ("_bucket", "_sum", "_count")} <= set(
        names
    )
    assert "sessionfleet_bind_latency_seconds" not in names
    assert "sessionfleet_recoveries" not in names
    assert "vllm:prefix_cache_hits_total" in names
    assert "vllm:kv_cache_usage_perc" in names
    assert not any(name in names for name in vllm.DEPRECATED_METRICS)
    assert not any(name.startswith("sessionfleet_sim_") for name in names)  # simulator-only


def _exposed(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_the_suffix_rules_match_a_real_exposition() -> None:
    """With samples in every family, what /metrics writes is within the computed set."""
    router = RouterMetrics(BindingTable())
    router.request("session", 200, 0.001)
    router.usage("w-0", Usage(100, 10, 90))
    router.usage("w-1", None)
    router.holds.labels("released").inc()
    router.sessions_created.labels("created").inc()
    router.flushes.labels("written").inc()
    agent = CollectorRegistry()
    state = AgentState(
        node="n",
        snapshot=Snapshot(
            True,
            gpus=(GpuSample(0, "GPU-0", "H100", 1, 2, 0.5),),
            processes=(ProcessSample(0, "GPU-0", 42, 1),),
        ),
        capable=True,
        operations={("checkpoint", "Failed"): 1},
    )

    class _Agent(Collector):
        def collect(self) -> Iterator[Any]:
            yield from families(state)

    agent.register(_Agent())
    engine = CollectorRegistry()
    engine.register(EngineCollector(SimEngine(EngineConfig(model="m"))))
    names = set(exported())
    assert _exposed(router.registry) <= names
    assert _exposed(agent) <= names
    assert {n for n in _exposed(engine) if n.startswith("vllm:")} <= names


def test_a_renamed_metric_is_caught() -> None:
    problems = unknown([("a panel", {"sessionfleet_session", "sessionfleet_sessions"})])
    assert len(problems) == 1
    assert "sessionfleet_session is not exported" in problems[0]
    assert "nearest: sessionfleet_sessions" in problems[0]


# --- tests: the dashboard and the rules ---------------------------------------------------


def test_every_dashboard_query_names_exported_metrics() -> None:
    queries = dashboard_queries()
    assert len(queries) > 30
    assert unknown(queries) == [], "\n".join(unknown(queries))


def test_every_rule_names_exported_metrics() -> None:
    queries = rule_queries()
    assert all(used for _, used in queries), "an alert that selects no metric"
    assert unknown(queries) == [], "\n".join(unknown(queries))


def test_the_dashboard_covers_every_component() -> None:
    used = set().union(*(names for _, names in dashboard_queries()))
    sources = {exported()[name] for name in used}
    assert {s.split(" ")[0] for s in sources} >= {"operator", "router", "node", "vLLM"}
    for must in (
        "sessionfleet_sessions",
        "sessionfleet_bind_latency_seconds_bucket",
        "sessionfleet_recomputed_tokens",
        "sessionfleet_drains_in_progress",
        "sessionfleet_drain_held_seconds",
        "sessionfleet_drain_deadline_seconds",
        "sessionfleet_recovery_duration_seconds_bucket",
        "sessionfleet_checkpoint_duration_seconds_bucket",
        "sessionfleet_checkpoint_size_bytes_bucket",
        "sessionfleet_checkpoint_failures_total",
        "sessionfleet_events_written_total",
        "sessionfleet_events_dropped_total",
        "sessionfleet_migrations_total",
        "sessionfleet_recoveries_total",
        "sessionfleet_restores_total",
        "sessionfleet_checkpoints_total",
        "sessionfleet_operator_leader",
        "sessionfleet_router_requests_total",
        "sessionfleet_router_added_latency_seconds_bucket",
        "sessionfleet_router_cached_tokens_total",
        "sessionfleet_agent_gpu_utilization_ratio",
    ):
        assert must in used, f"no panel shows {must}"


def test_dashboard_shape() -> None:
    board = dashboard()
    assert board["uid"] == "sessionfleet"
    panels = list(_walk(board["panels"]))
    panels = [p for p in panels if "gridPos" in p]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"panel {panel['title']!r} needs a description"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for dx in range(pos["w"]):
            for dy in range(pos["h"]):
                cell = (pos["x"] + dx, pos["y"] + dy)
                assert cell not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add(cell)


def _alerts_in_runbooks() -> set[str]:
    return set(re.findall(r"^## (Sessionfleet\w+)$", RUNBOOKS.read_text(), re.MULTILINE))


def test_every_alert_has_its_annotations_and_runbook() -> None:
    sections = _alerts_in_runbooks()
    for rule in rules():
        name = rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}", name
        assert name in sections, f"docs/runbooks.md needs a section '## {name}'"
        assert set(rule["labels"]) == {"severity"}, name
    assert sections == {rule["alert"] for rule in rules()}, "a runbook without its alert"


def test_the_chart_defaults_are_the_rule_file() -> None:
    """values.yaml's per-alert settings are the file's, so promtool tests what ships."""
    settings = VALUES["prometheusRule"]["alerts"]
    assert VALUES["prometheusRule"]["runbookBaseURL"] == RUNBOOK_BASE
    assert list(settings) == [rule["alert"] for rule in rules()]
    for rule in rules():
        name = rule["alert"]
        assert settings[name]["enabled"] is True, name
        assert settings[name]["for"] == rule["for"], name
        assert settings[name]["severity"] == rule["labels"]["severity"], name
        ends = re.search(r"(?:[<>]=?|[!=]=)\s*([-+0-9.eE]+)\s*$", rule["expr"])
        if "threshold" in settings[name]:
            assert ends is not None, f"{name}: its expr must end with `<op> <threshold>`"
            assert float(ends[1]) == settings[name]["threshold"], name


def test_operator_alerts_match_the_operator_job() -> None:
    """The chart swaps this one matcher for the release's job and namespace."""
    for rule in rules():
        if "sessionfleet_operator_" in rule["expr"] or "up{" in rule["expr"]:
            assert 'job="sessionfleet-operator-metrics"' in rule["expr"], rule["alert"]
