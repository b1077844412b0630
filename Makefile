# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Both install missing Debian packages first (scripts/install-deps.sh) and build.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: deps build test demo clean

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release > $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@grep "dmuon:" $(BUILD).configure.log || true
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Trains the GPT example with AdamW and with DMuon on 2 ranks and compares them (scripts/demo.sh).
demo: build
	BUILD=$(BUILD) bash scripts/demo.sh

clean:
	rm -rf $(BUILD) $(BUILD).configure.log

# Regenerates docs/BENCHMARKS.md and its figures (scripts/bench.sh; about 15-25 minutes on 2 cores).
.PHONY: bench
bench: build
	BUILD=$(BUILD) bash scripts/bench.sh
