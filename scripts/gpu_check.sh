#!/usr/bin/env bash
# The GPU device check (one H100/H200, within 10 minutes: --budget, 570 s by default).
# Writes its results as JSON.
#
#   bash scripts/gpu_check.sh [OUT.json] [extra args for python -m nemo_fp8_plugin.tools.gpu_check]
#
# Runs from the source tree with the machine's own python3 and torch, no install: it needs
# only torch (Triton for the compiled quantizer path); no PyYAML, no omegaconf, no network.
# The parts that need Transformer Engine or vLLM run only where those import (a NeMo or vLLM
# container) and otherwise say why they were skipped. Exit code 1 if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}/gpu_check.json}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m nemo_fp8_plugin.tools.gpu_check --out "$out" "$@"
