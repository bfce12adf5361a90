# Makefile - the commands people type; CMake does the building.
#
#   make          build (build/)
#   make test     install what is missing, build, run every test
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

.PHONY: all build deps test demo install asan tsan valgrind fuzz format \
	format-check bench clean

all: build

deps:
	@./scripts/install-deps.sh

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

test: deps build
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
# that TSan reports as ecx's own unlocks of a mutex never locked. Reports
# go to files (tsan-report.PID, the test's and each peer's) that
# scripts/tsan-reports.sh prints last, so a CI log's tail shows the race
# itself; a peer's report fails the run as the test's own does. A hang
# fails it too: past TSAN_TIMEOUT seconds (the test takes 2-3 minutes on
# 2 cores) timeout sends SIGABRT to the test and its peers (SIGKILL 60 s
# later if that does not end it), whose core files give the backtraces of
# where they hung (one core file, the last, where the kernel does not name
# them by pid), and that it hung is said again after the race reports.
TSAN_TIMEOUT ?= 1200
tsan: deps
	@cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DECX_TSAN=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build build-tsan -j $(JOBS) --target test_transfer ecx-test-peer
	cd build-tsan/tests && rm -f core core.[0-9]* tsan-report.* && \
		{ ulimit -c unlimited || :; } && start=$$(date +%s) && \
		{ TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp disable_coredump=0 log_path=$$PWD/tsan-report" \
		UCX_USE_MT_MUTEX=n ECX_TEST_BIN=$$PWD \
		timeout -s ABRT -k 60 $(TSAN_TIMEOUT) ./test_transfer || \
		{ rc=$$?; hung=; \
		if [ $$rc = 124 ] || { [ $$rc = 137 ] && \
			[ $$(($$(date +%s) - start)) -ge $(TSAN_TIMEOUT) ]; }; then \
		hung="make tsan: test_transfer HUNG: not done after $(TSAN_TIMEOUT) s (TSAN_TIMEOUT), killed by timeout (exit $$rc)"; \
		echo "$$hung; backtraces of its core files follow"; fi; \
		$(CURDIR)/scripts/backtraces.sh $$PWD; \
		$(CURDIR)/scripts/tsan-reports.sh $$PWD; \
		[ -z "$$hung" ] || echo "$$hung"; exit $$rc; }; } && \
		$(CURDIR)/scripts/tsan-reports.sh $$PWD

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
