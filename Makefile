# pd-inference: every command a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CHART := charts/pd-inference
HELM4 := .tools/helm-v4.2.1/helm
HELM3 := .tools/helm-v3.21.4/helm
HELM ?= $(HELM4)
ENV ?= dev
RELEASE ?= pd
NAMESPACE ?= pd-$(ENV)
export PD_HELM_BINARIES := $(abspath $(HELM4)):$(abspath $(HELM3))

.PHONY: help helm tools engines kube test lint render snapshot docs demo bench fmt clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements-dev.txt $(wildcard router/pyproject.toml router/dev/pyproject.toml)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@if [ -f router/pyproject.toml ]; then $(PY) -m pip install --quiet -e 'router[test]' -e router/dev; fi
	@touch $@

helm: $(VENV)/.installed ## Install the virtualenv and Helm 4 and 3 only (what render, snapshot and docs need)
	@scripts/install-tools.sh helm

tools: $(VENV)/.installed ## Install everything make test needs (idempotent; cached in .venv/ and .tools/): Helm, checkov, the engine stack, the control plane
	@scripts/install-tools.sh
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh
	@scripts/install-kube.sh
	@echo "tools: $$($(PY) --version) in $(VENV), $$($(PY) -m pip freeze | wc -l) packages" >&2

engines: ## Install the real engine stack (torch, LMCache, NIXL, each checked vLLM) into .tools/engine-stack (first run: ~7 GB, a few minutes)
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh

kube: ## Build the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok) into .tools/ (first run: ~20 minutes)
	@scripts/install-kube.sh

test: tools ## Run every test suite (chart, values, Argo CD, real engine stack, real control plane, router end to end)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

lint: helm ## The checks users run in their CI (ci/check.sh), plus ruff
	@scripts/install-tools.sh checkov
	ci/check.sh

render: helm ## Print an environment's manifests exactly as its Argo CD Application renders them (e.g. make render ENV=prod; a values/ENV.yaml outside the catalog renders as RELEASE in NAMESPACE)
	@test -f values/$(ENV).yaml || { echo "render: no values/$(ENV).yaml" >&2; exit 2; }
	@if args=$$($(PY) ci/gitops.py helm-args $(ENV) 2>/dev/null); then \
	  $(HELM) $$args $$($(PY) ci/gitops.py capabilities); \
	else \
	  $(HELM) template $(RELEASE) $(CHART) --namespace $(NAMESPACE) $(foreach f,$(shell $(PY) ci/envs.py files $(ENV)),-f $(f)) $$($(PY) ci/gitops.py capabilities); \
	fi

snapshot: helm ## Refresh the committed snapshot of the default render (review its diff)
	$(PY) -m tests.snapshot --update

docs: helm ## Regenerate values.schema.json descriptions and the chart README values table
	$(PY) ci/chartdoc.py --write

demo: $(VENV)/.installed ## Router plus simulated prefill and decode engines on loopback (ARGS=--once to exit)
	$(PY) -m pd_router_dev.demo $(ARGS)

bench: $(VENV)/.installed ## Router vs vllm-router vs direct, on zero-delay simulated engines
	$(PY) -m pd_router_dev.bench $(ARGS)

fmt: $(VENV)/.installed ## Format Python code
	$(VENV)/bin/ruff format router tests ci charts/pd-inference/files

clean: ## Remove the virtualenv (keeps .tools/: the Helm builds and the engine stack)
	rm -rf $(VENV)
