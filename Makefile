# The course's commands. `make help` lists them. Everything a fresh Debian 12 machine lacks is
# installed on first use by scripts/install-deps.sh (as root, or with sudo).
SHELL := /bin/bash
.DEFAULT_GOAL := help

DTC_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/dtc-course
DTC_VENV ?= $(DTC_CACHE)/venv
export DTC_CACHE DTC_VENV
export CCACHE_DIR ?= $(DTC_CACHE)/ccache
export CCACHE_SLOPPINESS ?= pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_PCH_EXTSUM ?= true
# Paths relative to the checkout in ccache's keys, and a checksum instead of each precompiled
# header (cmake/ccache-launcher.sh): every clone (and CI's) shares the cache.
export CCACHE_BASEDIR ?= $(CURDIR)
# The precompiled headers themselves, compiled once per content and shared by every clone and
# build folder (cmake/ccache-launcher.sh; about 0.4 GB with Clang, 1.3 GB with GCC).
export DTC_PCH_CACHE ?= $(DTC_CACHE)/pch
BUILD ?= build
# BUILD_TYPE=RelWithDebInfo (with its own BUILD=dir): a build with debug information, for gdb.
BUILD_TYPE ?=
CMAKE_TYPE_FLAG = $(if $(BUILD_TYPE),-DCMAKE_BUILD_TYPE=$(BUILD_TYPE))
LIGHT_BUILD ?= build-light
CTEST_FLAGS ?= --output-on-failure --timeout 300 -j $(shell nproc)

# Where the venv's LibTorch keeps its CMake files (and its libraries, which must win over
# Debian's libtorch when both are installed).
TORCH_PYTHON ?= $(DTC_VENV)/bin/python
TORCH_PREFIX = $$($(TORCH_PYTHON) -c 'import os, torch; print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))')

.PHONY: help deps deps-light deps-tools configure configure-light build build-light test run exercises readme-output \
        check-exercises format tidy docs slides clean grade mutants

help:
	@echo "Learners:"
	@echo "  make lessonNN               build your exercise: build/bin/lessonNN"
	@echo "  make test-lessonNN          test your exercise, test by test"
	@echo "  make run-lessonNN [ARGS=..] run the lesson's program (several ranks where it needs them)"
	@echo "  make run                    the course's main demo (a reference program)"
	@echo "  make run-lessonNN SOLUTION=1 run the reference solution's program instead of yours"
	@echo "Instructors:"
	@echo "  make test-lessonNN-solution test the reference solution of one lesson"
	@echo "  make test                   everything CI checks, on both LibTorch paths"
	@echo "  make grade [SUBMISSION=dir] [LESSONS=\"03 06\"] grade a learner's lessons/ with the course's tests"
	@echo "  make mutants [LESSON=NN]    every learner mistake in tests/mutants/ must lose points"
	@echo "  make exercises [FORCE=1]    regenerate lessons/ from solutions/"
	@echo "  make slides | docs          slide decks (HTML + PDF) | API docs (Doxygen HTML)"
	@echo "  make readme-output [LESSONS=\"06 07\"] rerun the programs whose output the READMEs quote"
	@echo "  make format | tidy          apply clang-format | run clang-tidy"

# DTC_SKIP_DEPS=1: a machine that brings its own (a GPU node with its PyTorch): no installer.
# DTC_BUNDLE=dir: with no Debian -dev packages either, the folder scripts/gpu-bundle.sh made.
DTC_BUNDLE ?=
BUNDLE_FLAG = $(if $(DTC_BUNDLE),-DDTC_BUNDLE="$(abspath $(DTC_BUNDLE))")
DEPS_PRIMARY := $(if $(DTC_SKIP_DEPS),,$(DTC_CACHE)/deps-primary.stamp)
DEPS_LIGHT := $(if $(DTC_SKIP_DEPS),,$(DTC_CACHE)/deps-light.stamp)
DEPS_TOOLS := $(if $(DTC_SKIP_DEPS),,$(DTC_CACHE)/deps-tools.stamp)

# --- dependencies --------------------------------------------------------------------------
$(DTC_CACHE)/deps-%.stamp: scripts/install-deps.sh scripts/paths.sh scripts/packages.txt
	@bash scripts/install-deps.sh $*
	@mkdir -p $(DTC_CACHE) && touch $@
deps: $(DTC_CACHE)/deps-primary.stamp
deps-light: $(DTC_CACHE)/deps-light.stamp
# The slide, docs and lint tools: only the targets that use them install them.
deps-tools: $(DTC_CACHE)/deps-tools.stamp

# --- configure and build -------------------------------------------------------------------
$(BUILD)/build.ninja: | $(DEPS_PRIMARY)
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_TYPE_FLAG) $(BUNDLE_FLAG) -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" \
	  -DDTC_TORCH_PYTHON="$(TORCH_PYTHON)"
$(LIGHT_BUILD)/build.ninja: | $(DEPS_LIGHT)
	cmake -S . -B $(LIGHT_BUILD) -G Ninja $(CMAKE_TYPE_FLAG) -DCMAKE_CXX_COMPILER=c++
configure: $(BUILD)/build.ninja
configure-light: $(LIGHT_BUILD)/build.ninja
build: configure
	cmake --build $(BUILD)
build-light: configure-light
	cmake --build $(LIGHT_BUILD)

# --- the learner loop ----------------------------------------------------------------------
lesson%: configure
	cmake --build $(BUILD) --target lesson$* lesson$*_tests

# The unit tests first, in one process (scripts/run-unit-tests.sh; ISOLATE=1: one process per
# test, through ctest); the end-to-end runs of the program (label e2e) only once they pass.
test-lesson%-solution: configure
	cmake --build $(BUILD) --target lesson$*_solution lesson$*_solution_tests
	@bash scripts/run-unit-tests.sh $(BUILD) $* solution
	ctest --test-dir $(BUILD) -L '^lesson$*-solution$$' -L '^e2e$$' --no-tests=ignore $(CTEST_FLAGS)

test-lesson%: configure
	cmake --build $(BUILD) --target lesson$* lesson$*_tests
	@bash scripts/run-unit-tests.sh $(BUILD) $* learner
	ctest --test-dir $(BUILD) -L '^lesson$*-learner$$' -L '^e2e$$' --no-tests=ignore $(CTEST_FLAGS)

# SOLUTION=1 runs the reference solution's program instead of your exercise.
run-lesson%: configure
	cmake --build $(BUILD) --target lesson$*$(if $(SOLUTION),_solution)
	@bash scripts/run-lesson.sh $(BUILD) $*$(if $(SOLUTION),_solution) $(ARGS)

# The course's main demo: the reference program of the newest runnable lesson.
run:
	@$(MAKE) --no-print-directory run-lesson01 SOLUTION=1

# --- the instructor loop and CI ------------------------------------------------------------
test:
	@bash scripts/test-all.sh

exercises:
	python3 scripts/exercises.py generate $(if $(FORCE),--force)

# Grade a learner's copy of lessons/ with the course's tests (default: this checkout's);
# LESSONS="03 06" grades those lessons only.
SUBMISSION ?= lessons
grade: | $(DEPS_PRIMARY)
	python3 scripts/grade.py $(SUBMISSION) --out grade --build build-grade $(if $(LESSONS),--lessons $(LESSONS)) \
	  --torch-dir "$$($(TORCH_PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
	@echo "Grades: grade/summary.md, grade/summary.html, JUnit XML in grade/lessonNN.xml"

# Mutation testing: every learner mistake in tests/mutants/ must lose points under the grader.
# LESSON=06 (or "03 06") for some lessons only.
LESSON ?=
mutants: | $(DEPS_PRIMARY)
	python3 scripts/mutants.py --build build-mutants $(if $(LESSON),--lessons $(LESSON)) \
	  --torch-dir "$$($(TORCH_PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))')"

check-exercises:
	python3 scripts/exercises.py check

format: | $(DEPS_TOOLS)
	python3 scripts/check_format.py --fix

docs: | $(DEPS_TOOLS)
	bash scripts/check_docs.sh build/docs

# The READMEs' quoted program output (blocks marked <!-- output: ... -->), measured again.
readme-output: build
	python3 scripts/readme_output.py --build $(BUILD) $(if $(LESSONS),--lessons $(LESSONS))

# Slides: charts from the programs' JSON, HTML (self-contained) and PDF per deck, checked.
slides: configure | $(DEPS_TOOLS)
	cmake --build $(BUILD)
	python3 scripts/slides.py --build $(BUILD) --check --screenshots --pdf
	@echo "Slides: $(BUILD)/slides/NN_topic.html and .pdf; screenshots in $(BUILD)/slides/shots/"

tidy: configure | $(DEPS_TOOLS)
	run-clang-tidy -quiet -p $(BUILD) '(common/src|lessons|solutions)/.*\.cpp$$'

clean:
	rm -rf $(BUILD) $(LIGHT_BUILD) build-grade grade build-mutants
