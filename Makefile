# The only place that installs anything. `make demo` and `make test` each set up a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
TRITON  ?= triton==3.6.0
VLLM    ?= vllm==0.33.0
SGLANG  ?= sglang==0.5.23
# What the modules of vLLM and SGLang that kvtier's integrations and their tests import need, pinned.
# Both engines and these are installed with --no-deps: their own requirements would replace the CPU
# torch above with a CUDA build of several GB.
ENGINE_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 apache-tvm-ffi==0.1.11 \
	attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 cloudpickle==3.1.3 \
	compressed-tensors==0.18.0 dill==0.4.1 einops==0.8.2 fastapi==0.165.0 frozenlist==1.8.0 \
	gguf==0.19.0 ipython==9.18.1 llguidance==1.9.1 loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 \
	openai==3.57.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 orjson==3.13.0 \
	partial-json-parser==0.2.1.1.post7 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 \
	pybase64==1.5.1 pyzmq==27.3.0 requests==2.34.2 sentencepiece==0.2.1 sniffio==1.3.1 \
	starlette==1.10.0 traitlets==5.16.1 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
STAMP   := $(VENV)/.installed
FAST    := $(VENV)/.fast-built

# The vLLM connector's tests run on Python 3.12 too, in a second venv (issue #28). No CPU build of
# torch for 3.12 is on this disk or on PyPI, so it takes PyPI's CUDA build, --no-deps, with its
# pure-Python requirements and only the NVIDIA libraries that libtorch_cuda.so links (`import torch`
# loads them, even without a GPU): cuSOLVER, NVTX, cuda-bindings and triton are left out; the vLLM
# tests use none of them on the CPU.
ifndef PY312
PY312   := $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null \
	     || pyenv prefix 3.12 2>/dev/null | sed 's|$$|/bin/python3.12|')
endif
VENV312 ?= .venv-vllm312
BIN312  := $(VENV312)/bin
TORCH312 ?= torch==2.14.1
TORCH312_DEPS := nvidia-cublas==13.1.1.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
	nvidia-cuda-runtime==13.0.96 nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61 \
	nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 \
	nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 nvidia-nvjitlink==13.5.37 \
	nvidia-nvshmem-cu13==3.4.5 \
	filelock==4.3.1 fsspec==2026.9.0 jinja2==3.1.6 markupsafe==3.0.4 mpmath==1.3.0 networkx==3.6.1 \
	setuptools==84.2.1 sympy==1.14.0 typing-extensions==4.16.0
STAMP312 := $(VENV312)/.installed
FAST312  := $(VENV312)/.fast-built
VLLM312  := $(if $(PY312),$(FAST312))

.PHONY: demo test lint fmt clean venv asan

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: on a machine without a GPU this takes the CPU build; triton runs kernels
	# on the CPU through its interpreter (TRITON_INTERPRET=1).
	$(BIN)/pip install -q "$(TORCH)" "$(TRITON)"
	$(BIN)/pip install -q -e ".[gpu,dev,hf]"
	# kvtier.integrations.vllm / .sglang are tested against the real engines (their Python parts).
	$(BIN)/pip install -q --no-deps "$(VLLM)" "$(SGLANG)" $(ENGINE_DEPS)
	touch $(STAMP)

$(STAMP312): pyproject.toml setup.py Makefile
	$(PY312) -m venv $(VENV312)
	$(BIN312)/pip install -q --upgrade pip
	# --no-cache-dir: these wheels are 2.5 GB, which a cache would keep a second time.
	$(BIN312)/pip install -q --no-cache-dir --no-deps "$(TORCH312)" $(TORCH312_DEPS)
	$(BIN312)/pip install -q -e ".[dev,hf]"
	$(BIN312)/pip install -q --no-deps "$(VLLM)" $(ENGINE_DEPS)
	touch $(STAMP312)

# The submit path's optional C helpers (src/kvtier/_fast.c, see engine/fastpath/fast.py, and
# src/kvtier/_slab.c, see slab.py), rebuilt when they change; without a C compiler kvtier runs
# those steps in Python / numpy / ctypes instead.
$(FAST): src/kvtier/_fast.c src/kvtier/_slab.c setup.py $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace > $(VENV)/fast-build.log 2>&1 \
	  || echo "kvtier: C helpers not built (see $(VENV)/fast-build.log); the submit runs without it"
	touch $(FAST)

$(FAST312): src/kvtier/_fast.c src/kvtier/_slab.c setup.py $(STAMP312)
	$(BIN312)/python setup.py -q build_ext --inplace > $(VENV312)/fast-build.log 2>&1 \
	  || echo "kvtier: C helpers not built for 3.12 (see $(VENV312)/fast-build.log)"
	touch $(FAST312)

demo: $(FAST)
	$(BIN)/kvtier demo

test: $(FAST) $(VLLM312)
	$(BIN)/ruff check src tests lab
	$(BIN)/ruff format --check src tests lab
	TRITON_INTERPRET=$${TRITON_INTERPRET-$$($(BIN)/python -c "import torch; print(0 if torch.cuda.is_available() else 1)")} \
	  $(BIN)/pytest -q $(PYTEST_ARGS)
	# The vLLM tests again on Python 3.12; the import first, since the tests skip where vLLM does not import.
ifneq ($(PY312),)
	VLLM_TARGET_DEVICE=cpu $(BIN312)/python -c "import vllm.distributed.kv_transfer.kv_connector.v1.base"
	$(BIN312)/pytest -q tests/integrations/vllm
else
	@echo "kvtier: no Python 3.12 found (set PY312=/path/to/python3.12): the vLLM tests ran on 3.11 only"
	@test -z "$$CI"
endif

# The C helpers' tests with both helpers built under AddressSanitizer + UBSan (gcc), in a scratch
# folder; the normal builds are put back afterwards.
ASAN_TESTS ?= tests/pool tests/lifecycle tests/engine
asan: $(FAST)
	@inc=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	suf=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"); \
	d=$$(mktemp -d); flags="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -shared -fPIC -I$$inc"; \
	gcc $$flags src/kvtier/_slab.c -o $$d/_slab$$suf && gcc $$flags src/kvtier/_fast.c -o $$d/_fast$$suf && \
	cp src/kvtier/_slab$$suf $$d/slab.keep && cp src/kvtier/_fast$$suf $$d/fast.keep && \
	cp $$d/_slab$$suf src/kvtier/ && cp $$d/_fast$$suf src/kvtier/ && \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" ASAN_OPTIONS=detect_leaks=0 \
	  $(BIN)/pytest -q $(ASAN_TESTS); rc=$$?; \
	cp $$d/slab.keep src/kvtier/_slab$$suf; cp $$d/fast.keep src/kvtier/_fast$$suf; rm -rf $$d; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check src tests lab

fmt: $(STAMP)
	$(BIN)/ruff format src tests lab
	$(BIN)/ruff check --fix src tests lab

clean:
	rm -rf $(VENV) $(VENV312) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache src/kvtier/_fast*.so src/kvtier/_slab*.so
