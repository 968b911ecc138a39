#!/usr/bin/env bash
# The C++ CPU kernels (nemo_fp8_plugin/numerics/_cpu_kernels.cpp) built with AddressSanitizer
# and UndefinedBehaviorSanitizer (NEMO_FP8_CPU_KERNEL_SANITIZE=1: -fsanitize=address,undefined
# -fno-sanitize-recover=all -fno-omit-frame-pointer, its own cache key and directory), run
# over the kernel tests: a read or write past a buffer, or undefined behaviour, aborts the
# run. scripts/test.sh calls it as one step (2.5 min of CPU time: 208 tests). Extra arguments
# go to pytest. Needs g++ with libasan (the compiler torch.compile uses on a CPU anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
cxx=${CXX:-g++}
asan=$("$cxx" -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "sanitize_kernels: $cxx has no libasan.so ($asan)" >&2; exit 1; }
export NEMO_FP8_CPU_KERNEL_SANITIZE=1
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the sanitized library must be what the tests load: check that it carries ASan's symbols
LD_PRELOAD=$asan "$python" - <<'PY'
from nemo_fp8_plugin.numerics import _cpu
path, _ = _cpu.build()
assert b"__asan_report" in path.read_bytes() and b"__ubsan_handle" in path.read_bytes(), path
print("sanitize_kernels: loaded", _cpu.load().path)
PY
t=tests/numerics
# --capture=sys: a sanitizer report (written to fd 2 just before the abort) stays visible
LD_PRELOAD=$asan "$python" -m pytest -q -p no:cacheprovider --capture=sys \
  $t/test_numerics_kernels.py $t/test_numerics_fakequant_cpu.py $t/test_numerics_kernel_shapes.py \
  $t/test_emulation_cpu_kernels.py \
  --deselect $t/test_numerics_kernels.py::test_build_is_cached_outside_the_package \
  --deselect $t/test_numerics_kernels.py::test_simd_build_is_eight_wide "$@"
# (the two deselected tests check cache paths, which the sanitized build does not use)
