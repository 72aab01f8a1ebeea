# sessionfleet — every build, check and test step lives here.
#
#   make test        lint, type-check, layer contracts, CRD drift check, unit and e2e tests
#                    (e2e builds the real control plane from Go modules on first use)
#   make crds        regenerate crds/ and the chart's CRD templates from the API models
#   make crds-check  fail when the committed CRDs or chart templates drift from the models

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv lint typecheck layers crds crds-check chart-docs kustomize-manifests unit test clean

# The editable install is "strict": a link tree under build/ joins the two source roots,
# operator/sessionfleet/ and controllers/sessionfleet/controllers/, into one package, so
# mypy, import-linter and other static tools see the package (setuptools' default editable finder is an
# import hook they cannot follow). The tree is relinked when the list of files changes.
PKG_FILES := $(sort $(shell find operator controllers -name '*.py' -o -name py.typed))
FILE_LIST := build/.package-files
$(shell mkdir -p build; echo "$(PKG_FILES)" | cmp -s - $(FILE_LIST) || echo "$(PKG_FILES)" > $(FILE_LIST))
EDITABLE := --config-settings editable_mode=strict

# The virtual environment is reused while pyproject.toml is unchanged.
$(VENV)/.deps: pyproject.toml
	@echo "==> installing sessionfleet and its development tools into $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' $(EDITABLE) > build/install.log 2>&1 \
		|| { cat build/install.log; exit 1; }
	touch $@

$(STAMP): $(VENV)/.deps $(FILE_LIST)
	$(PY) -m pip install --quiet --no-deps -e . $(EDITABLE) > build/relink.log 2>&1 \
		|| { cat build/relink.log; exit 1; }
	touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check operator controllers

typecheck: $(STAMP)
	$(VENV)/bin/mypy -p sessionfleet
	$(VENV)/bin/mypy demo

layers: $(STAMP)
	$(VENV)/bin/lint-imports

# The chart's CRD templates are generated with the CRDs and checked with them.
CHART_CRDS := charts/sessionfleet/templates/crds

crds: $(STAMP)
	$(VENV)/bin/sessionfleet crds --output-dir crds --chart-dir $(CHART_CRDS)
	deploy/kustomize/render.sh --if-available

crds-check: $(STAMP)
	$(VENV)/bin/sessionfleet crds --output-dir crds --chart-dir $(CHART_CRDS) --check

# The chart README's values table is generated from the comments in values.yaml.
chart-docs: $(STAMP)
	$(PY) tests/chart_values.py --write

# The kustomize base and router component are rendered from the chart with the pinned
# helm (make e2e-tools builds it; `make crds` re-renders them when it is there); a unit
# test fails when their CRDs drift, e2e/test_chart.py when anything does.
kustomize-manifests:
	deploy/kustomize/render.sh

unit: $(STAMP)
	$(VENV)/bin/pytest -q tests

test: lint typecheck layers crds-check unit test-e2e

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

-include e2e/e2e.mk

# The fleet simulator's strategy comparison on the built-in workload (docs/simulator.md):
# no cluster needed. Pass options through, for example
#   make simulate SIMULATE_ARGS="--sessions 20000 --drain-mode all --checkpoint both"
.PHONY: simulate
SIMULATE_ARGS ?=
simulate: $(STAMP)
	$(VENV)/bin/sessionfleet simulate $(SIMULATE_ARGS)

# The operator benchmark (bench/README.md, "Operator"): bind latency, API server writes
# per session, operator memory at 1,000 and 10,000 sessions, against a local cluster it
# starts and stops. Pass options through, e.g. BENCH_OPERATOR_ARGS="--big 0".
.PHONY: bench-operator
BENCH_OPERATOR_ARGS ?=
bench-operator: e2e-tools $(STAMP)
	$(PY) bench/operator/run.py --out build/bench-operator.json $(BENCH_OPERATOR_ARGS)

# Operator failover: the leader killed (or stopped) ten times; time to the new leader's
# first write. BENCH_FAILOVER_ARGS="--stop term" for a rolling update's handover.
.PHONY: bench-failover
bench-failover: e2e-tools $(STAMP)
	$(PY) bench/operator/failover.py --out build/bench-failover.json $(BENCH_FAILOVER_ARGS)

# Karpenter's consolidation against the operator's holds: from its decision (and its
# karpenter.sh/disrupted taint) to the node gone, without and with pinned sessions (then
# from the sessions' finish). BENCH_KARPENTER_ARGS="--rounds 5 --kubeconfig K".
.PHONY: bench-karpenter
BENCH_KARPENTER_ARGS ?=
bench-karpenter: e2e-tools $(STAMP)
	$(PY) bench/karpenter/run.py --out build/bench-karpenter.json $(BENCH_KARPENTER_ARGS)

# A restarted operator with 2,000 to 20,000 AgentSessions: time, CPU and memory until
# it is ready (bench/README.md, "Scale: a start with many sessions"), against a local
# cluster it starts. Another checkout's operator beside it:
#   BENCH_RESTART_ARGS="--sessions 1000,5000 --before OTHER/.venv/bin/sessionfleet"
.PHONY: bench-scale-restart
BENCH_RESTART_ARGS ?=
bench-scale-restart: e2e-tools $(STAMP)
	$(PY) bench/scale/restart.py --out build/bench-scale-restart.json $(BENCH_RESTART_ARGS)

# Memory of the operator's sessions and the router's binding table at 10,000 and
# 100,000 sessions, and the CPU of parsing one AgentSession (bench/README.md, "Scale:
# memory"); no cluster. BENCH_SCALE_ARGS="--sessions 1000,10000".
.PHONY: bench-scale-memory
BENCH_SCALE_ARGS ?=
bench-scale-memory: $(STAMP)
	$(PY) bench/scale/memory.py --out build/bench-scale-memory.json $(BENCH_SCALE_ARGS)

# The operator's own CPU per bind, in process (no cluster, no TLS): a bind's path with
# every request answered in process, and a profile of it (bench/README.md, "Scale: CPU
# per bind"). BENCH_BIND_ARGS="--workers 500 --binds 5000".
.PHONY: bench-bind-cpu
BENCH_BIND_ARGS ?=
bench-bind-cpu: $(STAMP)
	$(PY) bench/scale/bindcpu.py --out build/bench-bind-cpu.json $(BENCH_BIND_ARGS)

# The API client's CPU per request, its own connections against httpx's pool, on a local
# server with a set latency (bench/README.md, "Scale: CPU per bind"; no cluster, ~40 s).
# BENCH_REQUESTS_ARGS="--delay 0.1 --rate 300".
.PHONY: bench-requests
BENCH_REQUESTS_ARGS ?=
bench-requests: $(STAMP)
	$(PY) bench/scale/apirequests.py --out build/bench-requests.json $(BENCH_REQUESTS_ARGS)

# The KV store on the real vLLM (bench/README.md, "KV store"): throughput with the store
# off and on, save and load time per 1,000 tokens, a restart's next turns from the store
# against a full prefill; no cluster (~4 minutes on 2 cores).
#   BENCH_KVSTORE_ARGS="--sessions 4 --turns 6 --answer-tokens 32"
.PHONY: bench-kvstore
BENCH_KVSTORE_ARGS ?=
bench-kvstore: e2e-vllm-tools $(STAMP)
	$(PY) bench/kvstore/run.py --out build/bench-kvstore.json $(BENCH_KVSTORE_ARGS)

# py-spy, for the benchmarks' --profile (bench/profiler.py); not needed by the tests.
.PHONY: profile-tools
profile-tools: $(STAMP)
	$(PY) -m pip install --quiet 'py-spy>=0.4'

# The whole fleet at scale (bench/README.md, "Scale"): 125 KWOK nodes x 4 GPUs, 500
# workers, 100,000 live sessions, then churn at 200/s with 10 drains and 5 failures,
# against a local cluster it starts and stops (~40 minutes on 2 cores). A smaller run:
#   BENCH_SCALE_RUN_ARGS="--nodes 10 --workers 40 --live 5000 --churn-seconds 30"
# and where the operator's CPU goes in each phase: --profile (after make profile-tools).
.PHONY: bench-scale
BENCH_SCALE_RUN_ARGS ?=
bench-scale: e2e-tools $(STAMP)
	$(PY) bench/scale/run.py --out build/bench-scale.json $(BENCH_SCALE_RUN_ARGS)

# The Endpoint Picker benchmark (bench/README.md, "Endpoint Picker"): decision time and EPP
# CPU per decision for bound sessions' turns, open loop at 500 and 2,000 streams/s, against
# a local cluster it starts and stops. Pass options through, e.g.
#   BENCH_EPP_ARGS="--rates 200,1000 --exchanges decision --kubeconfig K"
.PHONY: bench-epp
BENCH_EPP_ARGS ?=
bench-epp: e2e-tools $(STAMP)
	$(PY) bench/epp/run.py --out build/bench-epp.json $(BENCH_EPP_ARGS)

# Header floods against a router process (bench/README.md, "Router: header floods"): 500
# connections holding maximal heads, API keys off and on, the router's resident memory.
#   make bench-router-heads BENCH_HEADS_ARGS="--source /tmp/old"   (another checkout)
.PHONY: bench-router-heads
BENCH_HEADS_ARGS ?=
bench-router-heads: $(STAMP)
	$(PY) bench/router/heads.py --out build/bench-router-heads.json $(BENCH_HEADS_ARGS)

# CPU per request of the router's client for workers (router/upstream.py) against
# aiohttp's client, on a trivial local server (bench/README.md, "Router: the tail"; ~20 s).
.PHONY: bench-router-client
bench-router-client: $(STAMP)
	$(PY) bench/router/client_cpu.py --out build/bench-router-client.json

# What one usage write costs the router, kube-apiserver and etcd, in CPU per write
# (bench/README.md, "Router: the tail"), against the local control plane.
.PHONY: bench-usage-writes
bench-usage-writes: e2e-tools $(STAMP)
	$(PY) bench/router/usage_writes.py

# The router driven by kubernetes-sigs' inference-perf (bench/README.md, "Router under
# inference-perf"), direct and routed in one run; installs the tool (Python >= 3.12) into
# ~/.cache/sessionfleet/loadtool/ with bench/loadtool/install.sh (PYTHON picks it).
.PHONY: bench-router-inference-perf
BENCH_LOADTOOL_ARGS ?= --tool-rate 100 --duration 10 --repeat 3
bench-router-inference-perf: e2e-tools $(STAMP)
	$(PY) bench/router/run.py --load-tool inference-perf --out build/bench-router-inference-perf.json \
		$(BENCH_LOADTOOL_ARGS)

# The same, with a third path: the Endpoint Picker (`sessionfleet epp`) behind a stand-in for
# Envoy (bench/epp/gateway.py, Python: its CPU is reported apart from the EPP's), direct,
# router and EPP alternating in one run (bench/README.md, "The EPP path under inference-perf").
.PHONY: bench-epp-inference-perf
bench-epp-inference-perf: e2e-tools $(STAMP)
	$(PY) bench/router/run.py --load-tool inference-perf --epp \
		--out build/bench-epp-inference-perf.json $(BENCH_LOADTOOL_ARGS)

# The router's fuzz suite at scale (bench/README.md, "Fuzzing"): 100,000 random cases of
# raw bytes, hostile headers and mutated bodies; make test runs 5,000 fixed ones.
#   make bench-fuzz FUZZ_EXAMPLES=300000
.PHONY: bench-fuzz
FUZZ_EXAMPLES ?= 100000
bench-fuzz: $(STAMP)
	SESSIONFLEET_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
		tests/test_router_fuzz.py

# The whole system on a real local control plane (docs/demo.md): cluster, chart, operator,
# router, agent, simulated workers, an agentic workload with a drain and an engine kill,
# and a report in demo-out/. The cluster stays up; `make demo-down` stops everything.
#   make demo DEMO_SESSIONS=40 DEMO_DRAIN_MODE=Migrate DEMO_CHECKPOINTS=off DEMO_FAST=1
#   make demo DEMO_ENGINE=vllm      (w-0 and w-1 on the real vLLM: docs/demo.md)
.PHONY: demo demo-down demo-status
DEMO_SESSIONS ?= 0
DEMO_DRAIN_MODE ?= WaitThenMigrate
DEMO_CHECKPOINTS ?= on
DEMO_FAST ?=
DEMO_ENGINE ?= sim
DEMO_STATE_DIR ?= .demo-state
DEMO_TRACE ?=
demo: e2e-tools venv $(if $(filter vllm,$(DEMO_ENGINE)),e2e-vllm-tools,)
	@$(PY) demo/run.py up --state-dir $(DEMO_STATE_DIR) --sessions $(DEMO_SESSIONS) \
		--drain-mode $(DEMO_DRAIN_MODE) --checkpoints $(DEMO_CHECKPOINTS) \
		--engine $(DEMO_ENGINE) $(if $(DEMO_FAST),--fast,) \
		$(if $(DEMO_TRACE),--trace $(DEMO_TRACE),)

demo-down: venv
	@$(PY) demo/run.py down --state-dir $(DEMO_STATE_DIR)

demo-status: venv
	@$(PY) demo/run.py status --state-dir $(DEMO_STATE_DIR)
