# The Tested Transformer. Two commands on a fresh clone:
#   make book   build the HTML book into _build/html
#   make test   run every test (unit tests, nbval over every notebook, the book build, the browser)
# Both create .venv if it is missing and install the exact pins into it.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# nbgrader (requirements-grade.txt), for `make grade` and for the tests that run nbgrader.
GRADE_STAMP := $(VENV)/.grade-installed
PORT ?= 8000
# Two notebooks run at once on two cores, so each kernel gets one thread: two kernels of two
# threads each would oversubscribe the cores, and PyTorch's thread pool slows down many times over.
NBVAL_ENV := OMP_NUM_THREADS=1
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	-n 2 --dist loadscope
# The notebooks again, as another CPU would run them: PyTorch's generic kernels (no AVX2 or
# AVX-512), MKL limited to SSE4.2, one thread. Float sums then happen in another order; a notebook
# whose stored outputs depend on that order fails here instead of on a reader's laptop.
GENERIC_CPU_ENV := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1
LAB_PORT ?= 8888
LAB_ARGS ?=

.PHONY: venv book test unit notebooks notebooks-generic-cpu book-tests lab serve assignments \
	browser-deps execute bench bench-grade lint clean grade

$(STAMP): requirements.txt constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

venv: $(STAMP)

book: venv
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is in _build/html/index.html"

# Debian's Chromium and its driver, for the browser test; installed only when missing.
browser-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

unit: venv $(GRADE_STAMP)
	$(PY) -m pytest -q -m "not book" tests

notebooks: venv
	$(NBVAL_ENV) $(PY) -m pytest -q $(NBVAL_FLAGS) book

notebooks-generic-cpu: venv
	$(GENERIC_CPU_ENV) $(PY) -m pytest -q -p no:cacheprovider $(NBVAL_FLAGS) book

book-tests: venv browser-deps
	$(PY) -m pytest -q -m book tests

test: venv browser-deps $(GRADE_STAMP)
	$(NBVAL_ENV) $(PY) -m pytest -q -m "not book" $(NBVAL_FLAGS) tests book
	@echo "The notebooks again, on generic CPU kernels with one thread:"
	$(GENERIC_CPU_ENV) $(PY) -m pytest -q -p no:cacheprovider $(NBVAL_FLAGS) book
	$(PY) -m pytest -q -m book tests

# Jupyter refuses to start as root unless told to; containers and cloud notebooks run as root.
lab: venv
	$(VENV)/bin/jupyter lab --notebook-dir=book --port=$(LAB_PORT) \
		$$( [ "$$(id -u)" != 0 ] || echo --allow-root ) $(LAB_ARGS)

serve: book
	$(PY) -m http.server $(PORT) --bind 127.0.0.1 --directory _build/html

# Re-execute notebooks in place (all of them, or NB=book/01_attention.ipynb) and print their times.
execute: venv
	$(PY) tests/execute_notebooks.py $(or $(NB),book)

# Speed and memory of the attention code, each a ratio against PyTorch's counterpart, into
# _build/bench/benchmark.md and .json. BENCH_ARGS: "--quick", "--device cuda", "--repeats 9",
# "--threads 1" (steadier times on a busy machine), "--out FILE.md".
bench: venv
	$(PY) scripts/benchmark.py $(BENCH_ARGS)

# The grader on a class of 56 notebooks over all assignments (isolation on, two at a time), and
# the cost of the kernel's confinement per child process, into _build/grading-bench/.
bench-grade: venv $(GRADE_STAMP)
	$(PY) scripts/grading_benchmark.py $(BENCH_GRADE_ARGS)

# Student versions of the assignments, every solution replaced by a stub, into _build/assignments/.
assignments: venv
	$(PY) scripts/make_assignments.py --out _build/assignments

# Grade handed-in notebooks, each in its own sandboxed process:
#   make grade SUBMITTED=folder [OUT=_build/grades]
# Also installs nbgrader (requirements-grade.txt) for instructors who grade with it.
$(GRADE_STAMP): $(STAMP) requirements-grade.txt constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-grade.txt -c constraints.txt
	@touch $@

grade: $(GRADE_STAMP)
	@test -n "$(SUBMITTED)" || { echo "usage: make grade SUBMITTED=folder [OUT=dir]"; exit 2; }
	$(PY) scripts/grade_assignments.py $(SUBMITTED) --out $(or $(OUT),_build/grades)

lint: venv
	$(VENV)/bin/ruff check utils tests scripts book

clean:
	rm -rf _build
