# pd-inference: every command a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# A missing interpreter is named, with the way out, instead of make's "Error 127".
NEED_PYTHON = command -v $(PYTHON) >/dev/null 2>&1 || { echo "venv: $(PYTHON) not found: install Python 3.11, or name one with make <target> PYTHON=/path/to/python3.11" >&2; exit 2; }
# HELM4, HELM3 (paths) and their versions, PIP_VERSION: pinned in scripts/tools.env only.
include scripts/tools.env
PIP := pip==$(PIP_VERSION)
HELM ?= $(HELM4)
ENV ?= dev

.PHONY: help helm helm4 tools engines kube test lint render snapshot docs demo demo-real bench goodput fmt clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(firstword $(MAKEFILE_LIST)) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# pip prints its progress to stderr, as every installer here does: `make render > x.yaml` stays manifests only.
$(VENV)/.installed: requirements-dev.txt $(wildcard router/pyproject.toml router/dev/pyproject.toml)
	@test -x $(PY) || { $(NEED_PYTHON); echo "venv: creating $(VENV) with $(PYTHON)" >&2; $(PYTHON) -m venv $(VENV); }
	@echo "venv: installing requirements-dev.txt, router[test] and router/dev into $(VENV) (first run: a minute or two)" >&2
	@$(PY) -m pip install --upgrade $(PIP) >&2
	@$(PY) -m pip install -r requirements-dev.txt >&2
	@if [ -f router/pyproject.toml ]; then $(PY) -m pip install -e 'router[test]' -e router/dev >&2; fi
	@echo "venv: $(VENV) ready" >&2
	@touch $@

helm: $(VENV)/.installed ## Install the virtualenv and Helm 4 and 3 only (what snapshot and docs need; render needs only Helm 4 and requirements-dev.txt)
	@scripts/install-tools.sh helm

# What ci/ needs to render and no more (make render): requirements-dev.txt, not the router and its
# test extras; a full install (.installed) covers it too.
$(VENV)/.ci: requirements-dev.txt
	@if [ -f $(VENV)/.installed ] && [ $(VENV)/.installed -nt requirements-dev.txt ]; then touch $@; exit 0; fi; \
	test -x $(PY) || { $(NEED_PYTHON); echo "venv: creating $(VENV) with $(PYTHON)" >&2; $(PYTHON) -m venv $(VENV); }; \
	echo "venv: installing requirements-dev.txt into $(VENV)" >&2; \
	$(PY) -m pip install --upgrade $(PIP) >&2 && $(PY) -m pip install -r requirements-dev.txt >&2 && touch $@

helm4: $(VENV)/.ci
	@scripts/install-tools.sh helm4

tools: $(VENV)/.installed ## Install everything make test needs (idempotent; cached in .venv/ and .tools/): Helm, checkov, the engine stack, the control plane
	@scripts/install-tools.sh
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh
	@scripts/install-kube.sh
	@echo "tools: $$($(PY) --version) in $(VENV), $$($(PY) -m pip freeze | wc -l) packages" >&2

engines: ## Install the real engine stack (torch, LMCache, NIXL, each checked vLLM, vLLM's CPU build) into .tools/engine-stack (first run: ~8 GB, a few minutes)
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh

kube: ## Build the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok) into .tools/ (first run: ~20 minutes)
	@scripts/install-kube.sh

test: tools ## Run every test suite (chart, values, Argo CD, real engine stack, real vLLM serving, real control plane, router end to end)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

lint: helm ## The checks users run in their CI (ci/check.sh), plus ruff
	@scripts/install-tools.sh checkov
	ci/check.sh

render: helm4 ## Print an environment's manifests exactly as its Argo CD Application renders them (e.g. make render ENV=prod; ENV must be in the catalog argocd/environments/, an error lists it); VALUES="a.yaml ..." layers more files last (ENV= VALUES=...: those files over the chart defaults, release pd)
	@$(PY) -m ci.render --helm $(HELM) --print "$(ENV)" $(if $(VALUES),--values $(VALUES))

snapshot: helm ## Refresh the committed snapshot of the default render (review its diff)
	$(PY) -m tests.snapshot --update

docs: helm ## Regenerate values.schema.json descriptions and the chart README values table
	$(PY) -m ci.chartdoc --write

# What the demo needs and no more: the router, the simulator and the openai client (seconds, not
# the test toolchain); a full install (.installed) covers it too.
$(VENV)/.demo: $(wildcard router/pyproject.toml router/dev/pyproject.toml)
	@if [ -f $(VENV)/.installed ] && [ $(VENV)/.installed -nt router/pyproject.toml ]; then touch $@; exit 0; fi; \
	test -x $(PY) || { $(NEED_PYTHON); echo "venv: creating $(VENV) with $(PYTHON)" >&2; $(PYTHON) -m venv $(VENV); }; \
	echo "venv: installing the router, the simulator and the openai client into $(VENV)" >&2; \
	$(PY) -m pip install --upgrade $(PIP) >&2 && $(PY) -m pip install -e 'router[demo]' -e router/dev >&2 && touch $@

demo: $(VENV)/.demo ## Router plus simulated prefill and decode engines on loopback (ARGS="--once", "--port 8080", "--model NAME", "--trace": print each request's trace, needs make tools; logs are kept)
	$(PY) -m pd_router_dev.demo $(ARGS)

demo-real: $(VENV)/.installed ## The demo on vLLM itself: its CPU build as prefiller and decoder (the tiny model made offline), KV over NIXL, the router from the chart; prints each answer's route and the colocated answer beside the disaggregated one (installs Helm and the engine stack's venv and CPU build: ~6.4 GB the first time; ARGS="--logs DIR")
	@scripts/install-tools.sh helm
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh demo
	$(PY) -m tests.real_engine.demo $(ARGS)

bench: $(VENV)/.installed ## Router vs vllm-router vs the engine directly (Go zero-delay engine, built once into .tools/fastengine), then mixed traffic, multi-turn chat, the decision's cost and a py-spy profile; ARGS=--help (~7 min)
	$(PY) -m pd_router_dev.bench $(ARGS)

goodput: $(VENV)/.installed helm ## The goodput sweep: colocated vs fixed split vs the goodput decision on two real vLLM engines, then on 8 simulated GPU-timed ones; prints the table, writes docs/goodput.png (installs Helm and the engine stack first; ARGS=--help; ~65 min: the real engines ~25 at the default --duration 30, the simulated ones ~40)
	@PYTHON=$(PYTHON) scripts/install-engine-stack.sh
	$(PY) -m tests.real_engine.goodput $(ARGS)

fmt: $(VENV)/.installed ## Format Python code
	$(VENV)/bin/ruff format router tests ci charts/pd-inference/files

clean: ## Remove the virtualenv (keeps .tools/: the Helm builds and the engine stack)
	rm -rf $(VENV)
