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
# nbgrader (requirements-grade.txt), for instructors and for its test, in an environment of its
# own layered on .venv: .venv stays exactly what `make book` gives a reader (requirements.txt and
# what it pulls in), so the notebooks are tested in the reader's environment.
GRADE_VENV := .venv-grade
GRADE_STAMP := $(GRADE_VENV)/.installed
PORT ?= 8000
# Two notebooks run at once on two cores, so each kernel gets one thread: two kernels of two
# threads each would oversubscribe the cores, and PyTorch's thread pool slows down many times over.
NBVAL_ENV := OMP_NUM_THREADS=1
# --dist loadscope: each worker takes a whole group at a time (a notebook, a test module, the
# book), longest first; conftest.py makes the groups and their order.
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	-n 2 --dist loadscope --no-loadscope-reorder
LAB_PORT ?= 8888
LAB_ARGS ?=

.PHONY: venv book test unit notebooks notebooks-generic-cpu book-tests lab serve assignments \
	browser-deps execute bench bench-grade lint clean grade pdf pdf-deps train-distributed \
	check-devices freeze-prose

# Everything installed is byte-compiled, on every core at once (pip would compile it file by
# file: a minute and a half on one core): a graded notebook's process may not write anywhere but
# its scratch folder, so it could not cache what it compiled, and would compile torch anew in
# every fresh process. Files that are not Python 3.11 (torch's py312_intrinsics.py) are skipped
# without a word, as pip skips them.
$(STAMP): requirements.txt constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -r requirements.txt \
		-c constraints.txt
	$(PY) -c "import compileall, sysconfig; \
		compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

venv: $(STAMP)

book: venv
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is in _build/html/index.html"

# Debian's Chromium headless shell and its driver, for the browser test; installed only when
# missing. Where they cannot be installed but the full `chromium` and its driver are there, the
# test runs in that (slower) instead.
# SKIP_BROWSER_DEPS=1: already done (.ci/run installs them first, then TeX and the PDF beside
# make test).
browser-deps:
	@if [ -z "$(SKIP_BROWSER_DEPS)" ] && { ! command -v chromium-headless-shell >/dev/null || \
		! command -v chromedriver >/dev/null; }; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		{ $$SUDO apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium-headless-shell \
			chromium-driver >/dev/null; } || \
		{ command -v chromium >/dev/null && command -v chromedriver >/dev/null && \
		  echo "chromium-headless-shell could not be installed: the browser test uses chromium"; }; \
	fi

# Debian's TeX for `make pdf`, installed only when missing: XeLaTeX and the LaTeX packages that
# Sphinx and Jupyter Book load, the FreeSerif/FreeSans/FreeMono fonts (Greek, arrows, math signs),
# Droid Sans Fallback and Symbola for what those lack (chapter 15's Japanese, Korean and emoji),
# Latin Modern Math, latexmk, xindy (sorts the index) and poppler's pdftotext, pdftoppm and
# pdfimages (the PDF's test). 135 MB to download, 430 MB on disk, 110 s (34 s in CI: .ci/run).
PDF_PACKAGES := texlive-xetex texlive-latex-recommended texlive-latex-extra \
	texlive-fonts-recommended fonts-freefont-otf fonts-droid-fallback fonts-symbola lmodern \
	latexmk xindy poppler-utils
pdf-deps:
	@missing=$$(for p in $(PDF_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "Installing Debian's $$(echo $$missing)"; \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
			$$missing >/dev/null; \
	fi

# The whole book as one PDF through LaTeX, into _build/pdf/the-tested-transformer.pdf, from a
# clean _build/pdf (scripts/build_pdf.py: Sphinx writes the LaTeX while pdf-deps installs TeX,
# then latexmk runs XeLaTeX), then its test (tests/test_pdf.py). Any Sphinx warning, undefined
# reference or citation, or character missing from the fonts fails it, its cause printed first.
pdf: venv
	$(PY) scripts/build_pdf.py
	$(PY) -m pytest -q -p no:cacheprovider --tb=short -m pdf tests/test_pdf.py

unit: venv $(GRADE_STAMP)
	$(PY) -m pytest -q -m "not book and not pdf" tests

notebooks: venv
	$(NBVAL_ENV) $(PY) -m pytest -q $(NBVAL_FLAGS) book

notebooks-generic-cpu: venv
	$(NBVAL_ENV) $(PY) -m pytest -q -p no:cacheprovider $(NBVAL_FLAGS) --nbval-cpu generic book

book-tests: venv browser-deps
	$(PY) -m pytest -q -m book tests

# Everything in one session on two workers of one thread each: the unit tests, every notebook
# under nbval, every notebook again as another CPU would run it (--nbval-cpu both: PyTorch's
# generic kernels, MKL limited to SSE4.2; a notebook whose stored outputs depend on the order of
# float sums fails here instead of on a reader's laptop), and the book built and visited by
# Chromium.
test: venv browser-deps $(GRADE_STAMP)
	$(NBVAL_ENV) $(PY) -m pytest -q -p no:cacheprovider -m "not pdf" $(NBVAL_FLAGS) \
		--nbval-cpu both tests book

# Jupyter refuses to start as root unless told to; containers and cloud notebooks run as root.
lab: venv
	$(VENV)/bin/jupyter lab --notebook-dir=book --port=$(LAB_PORT) \
		$$( [ "$$(id -u)" != 0 ] || echo --allow-root ) $(LAB_ARGS)

serve: book
	$(PY) -m http.server $(PORT) --bind 127.0.0.1 --directory _build/html

# Re-execute notebooks in place (all of them, or NB=book/01_attention.ipynb) and print their times,
# with one thread as the tests run them, so that the stored digits are the ones nbval reproduces.
execute: venv
	$(NBVAL_ENV) $(PY) tests/execute_notebooks.py $(or $(NB),book)

# Copy every chapter's Markdown, as it is now, into book/data/prose/NN.txt: the corpus that
# utils.data.book_prose gives chapters 15 and 18 to 21. Only on purpose: then re-execute those
# chapters (CONTRIBUTING.md, "The frozen prose").
freeze-prose: venv
	$(PY) -c "from utils.data import freeze_prose; print(len(freeze_prose()), 'chapters')"

# Chapter 9's model trained data-parallel by NPROC processes on the CPU (or one GPU each), with
# PyTorch's DistributedDataParallel; the same script runs across machines (see its docstring).
NPROC ?= 2
TRAIN_ARGS ?=
train-distributed: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		scripts/train_distributed.py $(TRAIN_ARGS)

# The book's code on every device present (the CPU, CUDA, Apple's MPS) against PyTorch and
# transformers there: equalities, bfloat16, a training run against the CPU's, attention with a
# key-less query, decoding speed; into _build/devices/check-devices.json and .md.
# CHECK_ARGS: "--quick", "--device cuda", "--out DIR".
check-devices: venv
	$(PY) scripts/check_devices.py $(CHECK_ARGS)

# Speed and memory of the book's code against the code a user would pick: one thread, the
# contenders interleaved in rounds, per-round CPU-time ratios, outputs asserted equal; into
# _build/bench/benchmark.md and .json. BENCH_ARGS: "--quick", "--only a,d", "--rounds 9",
# "--device cuda", "--out FILE.md". Chapter 13 reads book/data/bench/benchmark.json, a full run.
bench: venv
	$(PY) scripts/benchmark.py $(BENCH_ARGS)

# The grader on a class of 63 notebooks over all assignments (isolation on, two at a time), and
# the cost of the kernel's confinement per child process, into _build/grading-bench/.
bench-grade: venv
	$(PY) scripts/grading_benchmark.py $(BENCH_GRADE_ARGS)

# Student versions of the assignments, every solution replaced by a stub, into _build/assignments/.
assignments: venv
	$(PY) scripts/make_assignments.py --out _build/assignments

# nbgrader and the four packages it adds, in .venv-grade: a venv without packages of its own
# but those, which sees everything in .venv (a .pth file adds .venv's site-packages to its path),
# so pip there installs only what .venv lacks. Run it as .venv-grade/bin/nbgrader.
$(GRADE_STAMP): $(STAMP) requirements-grade.txt constraints.txt
	rm -rf $(GRADE_VENV)
	$(PY) -m venv --without-pip $(GRADE_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(GRADE_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_book_venv.pth"
	$(GRADE_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		-r requirements-grade.txt -c constraints.txt
	@touch $@

# Grade handed-in notebooks, each in its own sandboxed process:
#   make grade SUBMITTED=folder [OUT=_build/grades]
# Also installs nbgrader (requirements-grade.txt, into .venv-grade) for instructors who grade
# with it.
grade: $(GRADE_STAMP)
	@test -n "$(SUBMITTED)" || { echo "usage: make grade SUBMITTED=folder [OUT=dir]"; exit 2; }
	$(PY) scripts/grade_assignments.py $(SUBMITTED) --out $(or $(OUT),_build/grades)

lint: venv
	$(VENV)/bin/ruff check utils grader tests scripts book conftest.py

clean:
	rm -rf _build
