# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Both install missing Debian packages first (scripts/install-deps.sh), make or reuse the Python virtual
# environment (VENV, with python/requirements.txt's pinned torch from PyPI) and build.
BUILD ?= build
JOBS ?= $(shell nproc)
# ctest -j for `make test`: twice the cores. ctest counts a multi-rank test's ranks as processors, but ranks
# spend much of their time waiting on each other (gloo, mpirun's start), so -j $(JOBS) left the 2 cores
# about 40% idle; -j 4 on 2 cores: ctest 852 s instead of 1132 s, every test passing (docs/RELIABILITY.md).
TEST_JOBS ?= $(shell echo $$(( $$(nproc) * 2 )))
VENV ?= .venv
PYTHON ?= python3
# OpenBLAS picks its kernels by CPU model when it loads, and on a model it does not know it falls back to its
# generic SSE3 ones (Debian's 0.3.21 on an Emerald Rapids Xeon: sgemm 27 GFLOP/s a core instead of 102): on a CPU
# with AVX-512, every command here runs the SkylakeX kernels OpenBLAS runs on the AVX-512 CPUs it knows, unless the
# environment names a core (docs/ns.md, "OpenBLAS's kernels"). dmuon's Python package does the same.
AVX512_CPU := $(shell grep -m1 -w avx512f /proc/cpuinfo | grep -w avx512bw | grep -w avx512dq | grep -w avx512vl)
ifeq ($(origin OPENBLAS_CORETYPE),undefined)
ifneq ($(AVX512_CPU),)
export OPENBLAS_CORETYPE := SkylakeX
endif
endif
# The tests run those kernels whatever core the caller's environment names: dmuon warns when OpenBLAS runs kernels
# short of the CPU's AVX-512 (docs/ns.md), and tests compare whole outputs (a machine whose environment set
# OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU failed train_outputs_test and cli_messages_test on that line).
TEST_ENV := $(if $(AVX512_CPU),OPENBLAS_CORETYPE=SkylakeX)

.PHONY: deps venv build test build-sanitize test-sanitize demo clean titan-trainer-packages

deps:
	@bash scripts/install-deps.sh

# The venv is (re)installed when python/requirements*.txt change; its stamp records what it holds.
# requirements-nodeps.txt's packages are installed without their declared dependencies (its comment says why).
venv: $(VENV)/.requirements
$(VENV)/.requirements: python/requirements.txt python/requirements-nodeps.txt | deps
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "venv: installing python/requirements.txt into $(VENV) (a first install downloads about 3 GB)"
	$(VENV)/bin/python -m pip install --quiet -r python/requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -r python/requirements-nodeps.txt
	@cat python/requirements.txt python/requirements-nodeps.txt > $@

build: deps venv
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(abspath $(VENV))/bin/python \
		> $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@grep "dmuon:" $(BUILD).configure.log || true
	cmake --build $(BUILD) -j $(JOBS)

# torchtitan's Trainer test's own packages (python/requirements-titan-trainer.txt says why not in the venv): a
# folder in the build that only tests/python/torch_titan_trainer_test.py puts on its PYTHONPATH (tests/CMakeLists.txt).
TITAN_TRAINER_PACKAGES = $(BUILD)/titan_trainer_packages
titan-trainer-packages: $(TITAN_TRAINER_PACKAGES)/.requirements
$(TITAN_TRAINER_PACKAGES)/.requirements: python/requirements-titan-trainer.txt | venv
	@rm -rf $(TITAN_TRAINER_PACKAGES)
	@echo "titan-trainer-packages: installing python/requirements-titan-trainer.txt into $(TITAN_TRAINER_PACKAGES)"
	$(VENV)/bin/python -m pip install --quiet --no-deps --target $(TITAN_TRAINER_PACKAGES) \
		-r python/requirements-titan-trainer.txt
	@cp python/requirements-titan-trainer.txt $@

test: build titan-trainer-packages
	cd $(BUILD) && $(TEST_ENV) ctest --output-on-failure -j $(TEST_JOBS)

# The whole suite again, every binary built with -fsanitize=address,undefined (UB is an error), MPI
# tests included. LeakSanitizer skips OpenMPI's and hwloc's known leaks (scripts/sanitize/lsan.supp);
# nothing of dmuon's is suppressed. The library is built at -O1, as AddressSanitizer's documentation
# advises (a shorter build than -O3, and stacks that name every frame), the code that only drives it at
# -O0 (CMakeLists.txt): it runs in CI on 2 cores. Without the CUDA backend
# (DMUON_CUDA=OFF): the sanitizers instrument host C++ only, and no CUDA code runs without a GPU; `make
# test` compiles and links it.
SANITIZE_BUILD ?= $(BUILD)-sanitize
# fast_unwind_on_malloc=0: OpenMPI's libraries have no frame pointers, and without full stacks
# their leaks show as "<unknown module>", which no suppression can name.
# intercept_tls_get_addr=0: GCC 12's runtime misreads a dynamic TLS block that lands 16 bytes past a page
# boundary, and LeakSanitizer's tracer then crashes at exit after every test passed ("Tracer caught signal
# 11"), at random (tests/project/leak_check_dynamic_tls_test.cpp says how, and fails without this option).
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0:intercept_tls_get_addr=0 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/sanitize/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
build-sanitize: deps venv
	@cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
		-DPython3_EXECUTABLE=$(abspath $(VENV))/bin/python \
		-DDMUON_SANITIZE=address,undefined -DDMUON_CUDA=OFF \
		> $(SANITIZE_BUILD).configure.log 2>&1 || (cat $(SANITIZE_BUILD).configure.log; exit 1)
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)

test-sanitize: build-sanitize
	cd $(SANITIZE_BUILD) && $(SANITIZE_ENV) $(TEST_ENV) ctest --output-on-failure -j $(JOBS)

# Trains the GPT example with AdamW and with DMuon on 2 ranks and compares them, then the same GPT in
# PyTorch under FSDP2 with AdamW and with owner-centric DMuon (scripts/demo.sh).
demo: build
	BUILD=$(BUILD) VENV=$(VENV) bash scripts/demo.sh

# Leaves the venv (VENV) in place: `rm -rf .venv` removes it.
clean:
	rm -rf $(BUILD) $(BUILD).configure.log $(SANITIZE_BUILD) $(SANITIZE_BUILD).configure.log

# Regenerates docs/BENCHMARKS.md and its figures (scripts/bench.sh; about 15-25 minutes on 2 cores).
.PHONY: bench
bench: build
	BUILD=$(BUILD) bash scripts/bench.sh

# libFuzzer targets for every parser (tests/fuzz), built with clang in build-fuzz/; `make fuzz-run`
# runs each for FUZZ_SECONDS at nice 19, FUZZ_JOBS at once (scripts/fuzz.sh). Not part of `make test`:
# the committed corpora are replayed there by the fuzz_replay.* tests, built with g++.
FUZZ_BUILD ?= build-fuzz
.PHONY: fuzz fuzz-run
fuzz:
	@bash scripts/install-deps.sh --fuzz
	@CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDMUON_FUZZ=ON \
		> $(FUZZ_BUILD).configure.log 2>&1 || (cat $(FUZZ_BUILD).configure.log; exit 1)
	cmake --build $(FUZZ_BUILD) --target fuzzers -j $(JOBS)

fuzz-run: fuzz
	FUZZ_BUILD=$(FUZZ_BUILD) bash scripts/fuzz.sh
