# The two quick-start commands (README.md). Each one sets up .venv first (idempotent).
.PHONY: setup run test

setup:
	bash scripts/setup.sh

# The main job on the embedded default. Until the controller lands this is the objectives demo.
run: setup
	.venv/bin/drpo demo

# The whole test suite, markers included (CI runs exactly this).
test: setup
	bash scripts/test.sh
