# Two entry points for users: `make demo` and `make test`. Both create .venv and install on first use.
#   make demo     quantize a random MoE layer, run the float reference (and the GPU op when a GPU is present)
#   make test     run the pytest suite (GPU tests run only where a GPU, CuPy and cuDNN are installed)
#   make gpu-check OUT=dir   GPU tests + benchmark with logs in dir (scripts/gpu_check.sh)
#
# Without a GPU the CPU build of torch is installed, with the kernel tools (NVRTC, cuobjdump) the CPU tests check the
# kernels' builds and SASS with: TORCH_CPU pins the version; set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu where that index is reachable and no local wheel exists.
# With a GPU, CUDA picks the extra (cu12 or cu13) that brings cuDNN, its frontend and CuPy.

PYTHON ?= python3
VENV ?= .venv
CUDA ?= cu13
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?=
OUT ?= out

PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
STAMP := $(VENV)/.installed-$(if $(HAS_GPU),gpu,cpu)

.PHONY: demo test gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),yes)
	$(PY) -m pip install -q -e ".[test,$(CUDA)]"
else
	$(PY) -m pip install -q "$(TORCH_CPU)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test,kernel-tools]"
endif
	touch $@

demo: $(STAMP)
	$(PY) -m cudnn_moe demo

test: $(STAMP)
	$(PY) -m pytest -q

gpu-check:
	OUT=$(OUT) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
