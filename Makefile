# make demo: venv, install, train the tiny model on the embedded corpus (CPU), generate.
# make test: install the test extras and TorchRec (and, as root, the Debian packages some tests start),
# and run the suite.
# make embed-bench-deps: bench/embed.py's peer, TorchRec on CPU torch, into the venv.
# make gpu-wheels: the cp312 wheels the GPU machines lack, into .whl/, checked (bench/gpu_wheels.py).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test embed-bench-deps gpu-wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# TorchRec is the DLRM tests' reference (tests/test_dlrm.py): installed as for embed-bench-deps.
$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test,embed-bench]"
	$(BIN)/python -m pip install -q --no-deps torchrec==1.9.2 fbgemm-gpu-cpu==1.8.0
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	rm -rf runs/demo
	$(BIN)/hypertron train recipes/demo.yaml
	$(BIN)/hypertron generate --checkpoint runs/demo --prompt "def " --max-new-tokens 160 --temperature 0.7 --top-k 40

# Debian packages some tests start on loopback, and the C++ compiler the CPU's decode attention is
# built with (hypertron/kernels/cpu_decode.py) (installed when missing and running as root).
SYSTEM_PACKAGES := prometheus=prometheus chromium=chromium slurmctld=slurm-wlm munged=munge g++=g++

test: $(VENV)/.test-installed
	@sh tests/system/install.sh $(SYSTEM_PACKAGES)
	$(BIN)/python -m pytest -n 3 --dist worksteal --durations=15

# torchrec 1.9.2 asks for fbgemm-gpu, the CUDA build, which does not load on CPU torch: it and
# fbgemm-gpu-cpu go in without their dependencies, which the embed-bench extra lists instead.
embed-bench-deps: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[embed-bench]"
	$(BIN)/python -m pip install -q --no-deps torchrec==1.9.2 fbgemm-gpu-cpu==1.8.0

gpu-wheels: $(VENV)/.installed
	$(BIN)/python bench/gpu_wheels.py --dest .whl

clean:
	rm -rf $(VENV) runs
