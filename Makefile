# The two quick-start commands (README.md). Each one sets up .venv first (idempotent).
.PHONY: setup run test test-fast docs

setup:
	bash scripts/setup.sh

# The main job on the embedded default: RL training of SmolLM2-135M on arithmetic with DRPO, local Ray.
run: setup
	.venv/bin/drpo train

# The whole test suite, markers included (CI runs exactly this).
test: setup
	bash scripts/test.sh

# The edit-test loop: every test that needs no Ray cluster, no inference engine and no long run
# (markers ray, engine, slow, gpu deselected). CI runs the whole suite (`make test`).
test-fast: setup
	bash scripts/test.sh -m "not ray and not engine and not slow and not gpu"

# The documentation site (Sphinx + MyST) into docs/_build/html, warnings as errors: a broken link
# between pages or to a heading fails it. The reference pages are generated from the code.
docs: setup
	.venv/bin/python -m sphinx -E -W --keep-going -b html docs docs/_build/html
