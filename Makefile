# Two entry points for a fresh machine: `make demo` and `make test`. Each builds the venv it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" on a
# CPU-only machine whose pip would otherwise fetch the CUDA build.
TORCH_PIP_ARGS ?=
export OMP_NUM_THREADS ?= 1

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# On a machine without a CUDA GPU take the CPU build of torch first; the package metadata keeps torch>=2.13.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); fi
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[models,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python -m fxbudget.demo

test: install
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) *.egg-info
