# Both targets do all set-up on a fresh machine. torch is pinned to 2.13.0 (a local CPU wheel here;
# any other spec downloads GBs of CUDA packages), and installed first so nothing else pulls a newer one.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install verify test gate

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q "xformers==0.0.35" || echo "xformers not installable here: attention falls back to SDPA"

verify: install
	adopter verify --model bert-base-uncased

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q

gate: install
	adopter verify --model tiny-bert --baseline benchmarks/baselines/tiny-bert.json --max-regression 5%
