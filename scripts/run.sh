#!/usr/bin/env bash
# The main job: sets up (scripts/setup.sh), then runs `mixprec compare` on its embedded task (a
# tiny transformer on data generated in code): every precision mode trained from the same weights,
# a table of time, memory, losses and accuracy against O0, a recommendation with the reason for
# every other mode, and mixprec-compare/{report.json,curves.png,tensorboard/}. On the GPU when
# there is one; about a minute on a 2-core CPU. docs/compare.md explains it all. Extra arguments
# go to the command: ./scripts/run.sh --modes all --epochs 5, or --task your.module:make_task.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${MIXPREC_VENV:-.venv}
exec "$VENV/bin/python" -m mixprec compare --tensorboard "$@"
