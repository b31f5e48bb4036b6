# The two quick-start commands (README.md). Each one sets up .venv first (idempotent).
.PHONY: setup run test

setup:
	bash scripts/setup.sh

# The main job on the embedded default: RL training of SmolLM2-135M on arithmetic with DRPO, local Ray.
run: setup
	.venv/bin/drpo train

# The whole test suite, markers included (CI runs exactly this).
test: setup
	bash scripts/test.sh
