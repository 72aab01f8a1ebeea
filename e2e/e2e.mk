# e2e/e2e.mk: the real control plane for the e2e suite (see e2e/README.md).
# Included by the top-level Makefile, which defines VENV, PY and the `venv` target.
#
#   make e2e-tools     build etcd, kube-apiserver, -controller-manager, -scheduler,
#                      kubectl, KWOK, helm and promtool into ~/.cache/sessionfleet (cached)
#   make e2e-vllm-tools  install vLLM's CPU build and a tiny local model into
#                      ~/.cache/sessionfleet (cached; e2e/test_vllm.py runs the real engine)
#   make cluster-up    start a cluster that stays up; prints `export KUBECONFIG=...`
#   make cluster-down  stop it (logs stay in .e2e-state/logs)
#   make test-repeat   run the e2e suite N times against one cluster (N=5)
#   make test-e2e      run e2e/ against one fresh cluster shared by the xdist workers,
#                      or against $SESSIONFLEET_E2E_KUBECONFIG when that is set
#   make test-versions K8S_VERSION=v1.37.2
#                      the API, chart, operator, drain and upgrade tests on another
#                      control plane (not part of `make test`; results in docs/install.md)

# The cluster CLI is run by path, not with -m: see e2e/localcluster/__main__.py.
# K8S_VERSION=v1.37.2 picks the control plane (e2e/tools/k8s/<version>/); unset: v1.36.3.
export K8S_VERSION
E2E_CLUSTER := $(PY) e2e/localcluster
E2E_STATE_DIR ?= .e2e-state
# --durations: the slowest tests, in every run's output, to see where the wall time goes.
E2E_PYTEST_ARGS ?= -n 2 --durations=15
# A backstop per test; the test modules set tighter bounds with pytest-timeout marks.
E2E_TIMEOUT ?= 300

.PHONY: e2e-tools e2e-vllm-tools cluster-up cluster-down cluster-status test-e2e

e2e-tools:
	@bash e2e/build-tools.sh

# A virtual environment of its own (5.5 GB): vLLM pins torch and much else that the
# project's environment must not be tied to. The locations are e2e/localcluster/_vllm.py's.
e2e-vllm-tools: venv
	@$(PY) e2e/vllm/install.py

cluster-up: e2e-tools venv
	@$(E2E_CLUSTER) up --state-dir $(E2E_STATE_DIR)

cluster-down: venv
	@$(E2E_CLUSTER) down --state-dir $(E2E_STATE_DIR)
	@echo "unset KUBECONFIG SESSIONFLEET_E2E_KUBECONFIG"

cluster-status: venv
	@$(E2E_CLUSTER) status --state-dir $(E2E_STATE_DIR)

# `localcluster run` starts one cluster, runs pytest with SESSIONFLEET_E2E_KUBECONFIG
# pointing at it (so every xdist worker shares it) and stops the cluster however
# pytest ends: exit, failure, Ctrl-C or SIGTERM.
test-e2e: e2e-tools e2e-vllm-tools venv
	@if [ -n "$$SESSIONFLEET_E2E_KUBECONFIG" ]; then \
		echo "==> e2e against the running cluster $$SESSIONFLEET_E2E_KUBECONFIG"; \
		$(VENV)/bin/pytest e2e $(E2E_PYTEST_ARGS) --timeout=$(E2E_TIMEOUT); \
	else \
		echo "==> e2e against a fresh local cluster"; \
		$(E2E_CLUSTER) run -- $(VENV)/bin/pytest e2e $(E2E_PYTEST_ARGS) --timeout=$(E2E_TIMEOUT); \
	fi

# The e2e suite N times in a row against one cluster, stopping at the first failure:
# what a flaky test needs to show it is fixed. Select tests with E2E_PYTEST_ARGS, e.g.
#   make test-repeat N=20 E2E_PYTEST_ARGS="-n 1 -k stays_on_its_engine"
N ?= 5
.PHONY: test-repeat
test-repeat: e2e-tools e2e-vllm-tools venv
	@$(E2E_CLUSTER) run -- bash -c 'for run in $$(seq $(N)); do \
		echo "==> e2e run $$run of $(N)"; \
		$(VENV)/bin/pytest e2e $(E2E_PYTEST_ARGS) --timeout=$(E2E_TIMEOUT) -p no:cacheprovider \
			|| { echo "==> run $$run of $(N) failed"; exit 1; }; \
	done; echo "==> $(N) runs green"'

# The Kubernetes API surface the project depends on, on one control plane version: the
# CRDs and their CEL rules (test_api), the chart and its upgrade (test_chart*,
# test_upgrade), the operator's reconcilers (test_operator) and drains held by
# PodDisruptionBudgets (test_drain). Each version is built once into its own cache.
# Not part of `make test`: a cold build of a version takes ~7 minutes on 2 cores (399 s for
# v1.37.2, 2026-12-04; docs/install.md).
VERSION_TESTS ?= e2e/test_api.py e2e/test_chart.py e2e/test_chart_template.py \
	e2e/test_operator.py e2e/test_drain.py e2e/test_upgrade.py
.PHONY: test-versions
test-versions: venv
	@test -n "$(K8S_VERSION)" || { echo "make test-versions needs K8S_VERSION=vX.Y.Z" \
		"(one of: $$(ls e2e/tools/k8s | grep '^v' | tr '\n' ' '))"; exit 2; }
	@bash e2e/build-tools.sh
	@echo "==> $(VERSION_TESTS) on Kubernetes $(K8S_VERSION)"
	@$(E2E_CLUSTER) run -- $(VENV)/bin/pytest $(VERSION_TESTS) $(E2E_PYTEST_ARGS) \
		--timeout=$(E2E_TIMEOUT) -p no:cacheprovider
