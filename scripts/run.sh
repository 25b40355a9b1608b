#!/usr/bin/env bash
# The main job: sets up (scripts/setup.sh), then trains a small model with mixprec's loss
# scaling, printing loss and loss scale per step (on the GPU when there is one).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${MIXPREC_VENV:-.venv}
exec "$VENV/bin/python" examples/python/train_loss_scaling.py "$@"
