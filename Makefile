# Two commands on a fresh machine: `make demo` and `make test`.
# The pinned torch is a CPU wheel on the dev/CI machines; on a GPU machine with its own torch,
# use `make TORCH=` (keeps the installed one) or e.g. `make TORCH='torch>=2.11'`.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
NPROC ?= 2
# make test's pytest workers: test modules are spread over them whole (--dist loadfile), so a module's
# fixtures run once, the longest first (tests/conftest.py orders them). 2 or 3 workers took about the same time
# (1096 s vs 1078 s, tests/README.md) while the test processes still computed on 2 threads each; with one thread
# each, 3 workers: 721 s idle.
TEST_WORKERS ?= 3
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint install clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/pip install -q '$(TORCH)')
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) recipes/finetune.py --config configs/demo.yaml

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The unit tests only: no test marked slow, and only those may start a process (tests/helpers/procs.py).
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

lint: $(BIN)/.installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) outputs
