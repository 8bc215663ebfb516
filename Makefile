# Everything a fresh machine needs is installed by these targets into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv test run bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

venv: $(STAMP)

test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

run: venv
	$(PY) -m recipes.switch_demo

bench: venv
	$(PY) -m bench.plan_scale

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
