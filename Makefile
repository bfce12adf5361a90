# Makefile - the commands people type; CMake does the building.
#
#   make          build (build/)
#   make test     install what is missing, make the test venv, build, run
#                 every test
#   make venv     make (or reuse) .venv, the Python tests' environment
#   make demo     install what is missing, build, run the main job
#   make install  install libecx.so, libecx.a, ecx.h, ecx.pc and the ecx command
#   make asan     the whole suite under AddressSanitizer + UBSan (build-asan/)
#   make tsan     the end-to-end transfer test under ThreadSanitizer
#   make valgrind the end-to-end transfer test under valgrind memcheck
#   make fuzz     build the fuzz targets with clang and run each FUZZ_SECONDS
#   make format   clang-format every C file in place
#   make bench    ecx bench all

BUILD ?= build
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 20
CMAKE_FLAGS ?=
CTEST_FLAGS ?= --output-on-failure

.PHONY: all build deps venv test demo install asan tsan valgrind fuzz format \
	format-check bench clean

all: build

deps:
	@./scripts/install-deps.sh

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The Python tests run in .venv (torch 2.x, pytest, Mooncake's engine,
# vLLM's CPU build; tests/requirements.txt pins them): made once, reused
# while the pins are the same.
venv:
	@./scripts/venv.sh >/dev/null

test: deps venv build
	cd $(BUILD) && ctest $(CTEST_FLAGS) -j $(JOBS)

demo: deps build
	./$(BUILD)/tools/ecx demo

install: build
	cmake --install $(BUILD)

asan: export LSAN_OPTIONS = suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0
asan: export ASAN_OPTIONS = detect_leaks=1:abort_on_error=0
asan:
	@$(MAKE) --no-print-directory test BUILD=build-asan \
		CMAKE_FLAGS="-DECX_SANITIZE=ON $(CMAKE_FLAGS)"

# UCX and libzmq are not built with TSan: tests/tsan.supp says what that
# hides. Producer and consumer processes both run instrumented. A crash
# that no handler reports (a stack overflow says only "Segmentation
# fault") prints the backtraces of its core files (scripts/backtraces.sh);
# TSan disables core files unless told. UCX's worker lock stays a
# spinlock here (UCX_USE_MT_MUTEX=n; ecx asks for a mutex, xfer/ucx.c):
# UCX takes it in uninstrumented code and releases the mutex by tail calls
# that TSan reports as ecx's own unlocks of a mutex never locked.
# scripts/tsan-run.sh runs the test: reports go to files (tsan-report.PID,
# the test's and each peer's) printed last, so a CI log's tail shows the
# race itself, and a peer's report fails the run as the test's own does;
# past TSAN_TIMEOUT seconds (the test takes 2-3 minutes on 2 cores) a hang
# fails it with the backtraces of where the test and its peers hung; a
# Ctrl-C stops them all.
TSAN_TIMEOUT ?= 1200
tsan: deps
	@cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DECX_TSAN=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j $(JOBS) --target test_transfer ecx-test-peer
	$(CURDIR)/scripts/tsan-run.sh build-tsan/tests $(TSAN_TIMEOUT) \
		$(CURDIR)/tests/tsan.supp

valgrind: deps build
	cd $(BUILD)/tests && ECX_TEST_BIN=$$PWD ECX_TEST_TIME_SCALE=10 valgrind --error-exitcode=9 \
		--leak-check=full --errors-for-leak-kinds=definite \
		--show-leak-kinds=definite ./test_transfer

fuzz: deps
	@CC=clang cmake -S . -B build-fuzz -DECX_FUZZ=ON -DECX_TESTS=OFF >/dev/null
	@cmake --build build-fuzz -j $(JOBS)
	@./scripts/run-fuzz.sh build-fuzz/fuzz $(FUZZ_SECONDS)

format:
	git ls-files '*.c' '*.h' | xargs clang-format -i

format-check:
	git ls-files '*.c' '*.h' | xargs clang-format --dry-run --Werror

bench: build
	./$(BUILD)/tools/ecx bench all

clean:
	rm -rf build build-asan build-fuzz build-tsan
