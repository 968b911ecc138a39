"""Single-pass CPU quantizers: a small C++ library built at first use, bit-exact with the
eager reference (:mod:`.reference`).

Why C++: on x86 CPUs without a float8 conversion instruction (AVX2) torch and Inductor cast
fp32 to float8 one element at a time, and the compiled kernel reads the tensor twice (amax,
then scale and cast). ``_cpu_kernels.cpp`` encodes eight lanes at a time with integer
arithmetic and processes one tile row at a time (amax, scale, cast while it is in cache),
threaded over tile rows with OpenMP. The same file holds the emulation's fake quantizers
(quantize, then dequantize to fp32 in the same pass: block scaling and MXFP8 with row or
column tiles, per tensor, a given scale with its amax) and the NVFP4 kernel (packed E2M1
codes and E4M3 scales, or the fp32 fake-quantized values). Threads: :func:`threads_for`
(one for small tensors; capped by the available cores and the load average).

Build: the C++ compiler Inductor uses (``$CXX``, else ``g++``, else ``c++``), ``-O3
-fopenmp`` plus ``-mavx2 -mf16c`` where ``/proc/cpuinfo`` lists both; a plain C ABI loaded
with :mod:`ctypes`, no torch headers, so it builds in a few seconds. The library is cached
under ``$NEMO_FP8_CACHE_DIR``, else ``$XDG_CACHE_HOME/nemo_fp8_plugin``, else
``~/.cache/nemo_fp8_plugin`` (``cpu_kernels/``), keyed by a hash of the source, the
compiler's version and the flags, written atomically (safe for concurrent processes).
Nothing to install: it needs only the compiler that torch.compile needs on a CPU anyway.

If there is no compiler, the build fails, or ``NEMO_FP8_CPU_KERNEL=0``, :func:`kernels`
returns None (one ``RuntimeWarning`` names the reason) and the public quantizers run the
compiled or eager path instead, which give the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import TypedDict

import torch

from .formats import fp8_dtype

__all__ = [
    "CpuKernels",
    "kernels",
    "load",
    "status",
    "cache_dir",
    "compiler",
    "ABI_VERSION",
    "threads_for",
]

ABI_VERSION = 3
_SOURCE = Path(__file__).with_name("_cpu_kernels.cpp")
_IN = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FMT = {"e4m3": 0, "e5m2": 1}
_BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
_SIMD_FLAGS = ("-mavx2", "-mf16c")
_SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
)
"""Added by ``NEMO_FP8_CPU_KERNEL_SANITIZE=1`` (scripts/sanitize_kernels.sh): an
AddressSanitizer + UndefinedBehaviorSanitizer build that aborts at the first finding. It has
its own cache key (the flags are hashed) and loads only into a python started with
``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``."""

_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "error": None, "build_s": None, "path": None}

_c_int, _c_i64, _c_float, _c_ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def enabled() -> bool:
    """False when ``NEMO_FP8_CPU_KERNEL`` is ``0``/``false``/``no``."""
    value = os.environ.get("NEMO_FP8_CPU_KERNEL", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


SMALL_NUMEL = 1 << 18
"""Below this many elements a kernel runs on one thread: waking a second one costs more
than it saves, and far more on an oversubscribed machine."""


class _LoadCache(TypedDict):
    at: float
    """``time.monotonic()`` of the last read of the load average."""
    threads: int


_load_cache: _LoadCache = {"at": -1.0, "threads": 1}


def available_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_threads(cores: int, load1: float) -> int:
    """Threads worth starting on ``cores`` cores at a one-minute load average ``load1``
    (which counts this process): one per core not kept busy by others, at least one.
    On an oversubscribed machine OpenMP threads that wait for each other at every
    barrier lose their time slices, which measured 2-3x slower than one thread."""
    return max(1, min(cores, int(cores + 1 - load1 + 0.5)))


def threads_for(numel: int) -> int:
    """OpenMP threads for a kernel over ``numel`` elements: ``$NEMO_FP8_CPU_THREADS`` when
    set; else 1 below :data:`SMALL_NUMEL`; else ``torch.get_num_threads()`` capped by the
    available cores and by :func:`idle_threads` of the load average (read at most once a
    second)."""
    forced = os.environ.get("NEMO_FP8_CPU_THREADS", "").strip()
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    if numel < SMALL_NUMEL:
        return 1
    now = time.monotonic()
    if now - _load_cache["at"] > 1.0:
        try:
            load1 = os.getloadavg()[0]
        except OSError:
            load1 = 0.0
        cores = available_cores()
        _load_cache["threads"] = idle_threads(cores, load1)
        _load_cache["at"] = now
    return max(1, min(torch.get_num_threads(), _load_cache["threads"]))


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX`` (as Inductor and torch.utils.cpp_extension
    read it), else ``g++``, else ``c++`` on the PATH; None if there is none."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
    """Where built libraries are kept (never inside the package or the repository)."""
    root = os.environ.get("NEMO_FP8_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) if xdg else Path.home() / ".cache"
        root = str(base / "nemo_fp8_plugin")
    return Path(root) / "cpu_kernels"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def sanitize() -> bool:
    """True when ``NEMO_FP8_CPU_KERNEL_SANITIZE`` is ``1``/``true``/``yes``/``on``."""
    value = os.environ.get("NEMO_FP8_CPU_KERNEL_SANITIZE", "").strip().lower()
    return value in ("1", "true", "yes", "on")


def _flags(simd: bool | None, defines: tuple[str, ...] = ()) -> list[str]:
    if simd is None:
        simd = {"avx2", "f16c"} <= _cpu_flags()
    flags = list(_BASE_FLAGS) + (list(_SIMD_FLAGS) if simd else ["-DNEMO_FP8_NO_SIMD"])
    if sanitize():
        flags += _SANITIZE_FLAGS
    return flags + [f"-D{d}" for d in defines]


def _version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else ""


def build(
    simd: bool | None = None,
    cxx: str | None = None,
    directory: Path | None = None,
    defines: tuple[str, ...] = (),
) -> tuple[Path, float]:
    """Compile the library (unless the cache has it); returns ``(path, seconds spent)``.

    ``simd``: True for the AVX2 code, False for the portable one, None to pick by the CPU.
    ``defines``: extra ``NAME=VALUE`` macros (tests shrink ``NF8_PANEL_BYTES``).
    ``directory``: where to cache it (default :func:`cache_dir`); ignored under
    ``NEMO_FP8_CPU_KERNEL_SANITIZE``, whose builds all go to ``cache_dir()/sanitize``.
    Raises ``RuntimeError`` naming the reason when it cannot build.
    """
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++)")
    flags = _flags(simd, defines)
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, cxx.encode(), _version(cxx).encode(), " ".join(flags).encode()])
    ).hexdigest()[:20]
    if sanitize():  # one shared build per variant: a sanitized compile takes a minute
        directory = cache_dir() / "sanitize"
    directory = directory or cache_dir()
    target = directory / f"nemo_fp8_cpu_{key}.so"
    if target.is_file():
        return target, 0.0
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *flags, "-o", tmp, str(_SOURCE)], capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, time.perf_counter() - start


class CpuKernels:
    """The loaded library. Inputs are contiguous CPU tensors (fp32, bf16 or fp16); every
    call releases the GIL and runs on :func:`threads_for` OpenMP threads (one for small
    tensors, fewer on a loaded machine)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        lib.nf8_abi_version.restype = _c_int
        if lib.nf8_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {lib.nf8_abi_version()}, expected {ABI_VERSION}")
        lib.nf8_simd_width.restype = _c_int
        lib.nf8_tiles.restype = _c_int
        lib.nf8_tiles.argtypes = [_c_ptr, _c_int, _c_i64, _c_i64, _c_i64, _c_int, _c_int]
        lib.nf8_tiles.argtypes += [_c_int, _c_int, _c_int, _c_int, _c_float, _c_float]
        lib.nf8_tiles.argtypes += [_c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64]
        lib.nf8_amax.restype = _c_int
        lib.nf8_amax.argtypes = [_c_ptr, _c_int, _c_i64, ctypes.POINTER(_c_float), _c_int]
        lib.nf8_scaled_cast.restype = _c_int
        lib.nf8_scaled_cast.argtypes = [_c_ptr, _c_int, _c_i64, _c_float, _c_int, _c_ptr, _c_int]
        p = _c_ptr
        lib.nf8_fake_quant_tiles.restype = _c_int
        lib.nf8_fake_quant_tiles.argtypes = [p, _c_int, _c_i64, _c_i64, _c_int, _c_int, _c_int]
        lib.nf8_fake_quant_tiles.argtypes += [_c_int, _c_int, _c_int, _c_float, _c_float]
        lib.nf8_fake_quant_tiles.argtypes += [p, p, p, _c_int]
        lib.nf8_fake_quant_scaled.restype = _c_int
        lib.nf8_fake_quant_scaled.argtypes = [p, _c_int, _c_i64, _c_float, _c_float, _c_int]
        lib.nf8_fake_quant_scaled.argtypes += [p, p, p, _c_int]
        fptr = ctypes.POINTER(_c_float)
        lib.nf8_scale_from_amax.restype = _c_int
        lib.nf8_scale_from_amax.argtypes = [_c_float, _c_float, _c_int, _c_int, _c_float]
        lib.nf8_scale_from_amax.argtypes += [_c_float, fptr, fptr]
        lib.nf8_amax_nan.restype = _c_int
        lib.nf8_amax_nan.argtypes = [p, _c_int, _c_i64, fptr, _c_int]
        lib.nf8_nvfp4.restype = _c_int
        lib.nf8_nvfp4.argtypes = [p, _c_int, _c_i64, _c_i64, _c_int, _c_float, p, p, p, p, p]
        lib.nf8_nvfp4.argtypes += [_c_int]
        self._lib = lib
        self.path = path
        # torch's own float8 / E8M0 -> fp32 conversions, so decoded bits (NaN included)
        # are the reference's
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        self._lut = {fmt: codes.view(fp8_dtype(fmt)).float().contiguous() for fmt in _FMT}
        self._e8lut = codes.view(torch.float8_e8m0fnu).float().contiguous()
        self.simd_width: int = lib.nf8_simd_width()
        """8 for the AVX2 build, 1 for the portable one."""

    @staticmethod
    def _threads(numel: int | None = None) -> int:
        if numel is None:
            return max(1, torch.get_num_threads())
        return threads_for(numel)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"nemo_fp8 CPU kernel {what} returned {rc}")

    def tiles(
        self,
        x: torch.Tensor,
        bm: int,
        bn: int,
        fmt: str,
        *,
        mx: bool,
        pow2: bool = False,
        eps: float = 0.0,
        vinf: float = 0.0,
        panel_bytes: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile-quantize a contiguous ``[B, M, K]`` tensor. Returns ``(data [B, M, K]
        float8, scales [B, ceil(M/bm), ceil(K/bn)])``: fp32 ``scale_inv`` (block scaling)
        or uint8 biased E8M0 exponents (``mx``). ``panel_bytes`` caps the input bytes of one
        unit of work (whole tiles of one tile row; 0: the default, 4 MiB)."""
        b, m, k = x.shape
        mt, kt = -(-m // bm), -(-k // bn)
        data = torch.empty((b, m, k), dtype=fp8_dtype(fmt))
        scales = torch.empty((b, mt, kt), dtype=torch.uint8 if mx else torch.float32)
        # the reference compares amax with eps in fp32: round eps the same way
        eps32 = float(torch.tensor(eps, dtype=torch.float32))
        rc = self._lib.nf8_tiles(
            x.data_ptr(),
            _IN[x.dtype],
            b,
            m,
            k,
            bm,
            bn,
            _FMT[fmt],
            int(mx),
            int(pow2),
            int(eps > 0.0),
            eps32,
            vinf,
            data.data_ptr(),
            None if mx else scales.data_ptr(),
            scales.data_ptr() if mx else None,
            self._threads(x.numel()),
            panel_bytes,
        )
        self._check(rc, "nf8_tiles")
        return data, scales

    def amax(self, x: torch.Tensor) -> float:
        """NaN-ignoring ``max |x|`` of a contiguous tensor."""
        out = _c_float(0.0)
        rc = self._lib.nf8_amax(
            x.data_ptr(), _IN[x.dtype], x.numel(), ctypes.byref(out), self._threads(x.numel())
        )
        self._check(rc, "nf8_amax")
        return float(out.value)

    def scaled_cast(self, x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
        """``sat_cast(x * scale)`` of a contiguous tensor, same shape, float8."""
        data = torch.empty(x.shape, dtype=fp8_dtype(fmt))
        rc = self._lib.nf8_scaled_cast(
            x.data_ptr(),
            _IN[x.dtype],
            x.numel(),
            scale,
            _FMT[fmt],
            data.data_ptr(),
            self._threads(x.numel()),
        )
        self._check(rc, "nf8_scaled_cast")
        return data

    # ------------------------------------------------------------ fake quantization

    def fake_quant_tiles(
        self,
        x: torch.Tensor,
        bm: int,
        bn: int,
        fmt: str,
        *,
        mx: bool,
        pow2: bool = False,
        eps: float = 0.0,
        vinf: float = 0.0,
    ) -> torch.Tensor:
        """``dequantize(quantize(x))`` in fp32 of a contiguous 2-D ``[M, K]`` tensor with
        ``bm x bn`` tiles (block scaling, or MXFP8 with ``mx``), in one pass; ``bn == 1``
        (column tiles) reads rows and keeps 8 columns' amaxes in a vector."""
        m, k = x.shape
        out = torch.empty((m, k), dtype=torch.float32)
        eps32 = float(torch.tensor(eps, dtype=torch.float32))
        rc = self._lib.nf8_fake_quant_tiles(
            x.data_ptr(),
            _IN[x.dtype],
            m,
            k,
            bm,
            bn,
            _FMT[fmt],
            int(mx),
            int(pow2),
            int(eps > 0.0),
            eps32,
            vinf,
            self._lut[fmt].data_ptr(),
            self._e8lut.data_ptr(),
            out.data_ptr(),
            self._threads(x.numel()),
        )
        self._check(rc, "nf8_fake_quant_tiles")
        return out

    def scale_from_amax(
        self, amax: float, fmt: str, *, pow2: bool, eps: float, vinf: float
    ) -> tuple[float, float]:
        """``(scale, scale_inv)`` of :func:`~.scaling.scale_from_amax` and its reciprocal."""
        scale, inv = _c_float(0.0), _c_float(0.0)
        eps32 = float(torch.tensor(eps, dtype=torch.float32))
        fmax = 448.0 if fmt == "e4m3" else 57344.0
        self._lib.nf8_scale_from_amax(
            amax,
            fmax,
            int(pow2),
            int(eps > 0.0),
            eps32,
            vinf,
            ctypes.byref(scale),
            ctypes.byref(inv),
        )
        return float(scale.value), float(inv.value)

    def fake_quant_scaled(
        self, x: torch.Tensor, scale: float, scale_inv: float, fmt: str, *, amax: bool
    ) -> tuple[torch.Tensor, float | None]:
        """Per-tensor ``lut[cast(x * scale)] * scale_inv`` (fp32, ``x``'s shape) and, with
        ``amax``, the NaN-ignoring ``max |x|`` from the same pass."""
        out = torch.empty(x.shape, dtype=torch.float32)
        got = _c_float(0.0)
        rc = self._lib.nf8_fake_quant_scaled(
            x.data_ptr(),
            _IN[x.dtype],
            x.numel(),
            scale,
            scale_inv,
            _FMT[fmt],
            self._lut[fmt].data_ptr(),
            out.data_ptr(),
            ctypes.byref(got) if amax else None,
            self._threads(x.numel()),
        )
        self._check(rc, "nf8_fake_quant_scaled")
        return out, (float(got.value) if amax else None)

    def amax_nan(self, x: torch.Tensor) -> float:
        """NaN-propagating ``max |x|`` (``torch.amax`` of ``|x|``)."""
        out = _c_float(0.0)
        rc = self._lib.nf8_amax_nan(
            x.data_ptr(), _IN[x.dtype], x.numel(), ctypes.byref(out), self._threads(x.numel())
        )
        self._check(rc, "nf8_amax_nan")
        return float(out.value)

    def nvfp4(
        self,
        x: torch.Tensor,
        bm: int,
        global_amax: float,
        u: torch.Tensor | None,
        *,
        packed: bool,
        fake: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """NVFP4 of a contiguous ``[M, K]`` tensor (numerics/nvfp4.py): ``(packed E2M1
        codes [M, K/2] uint8, E4M3 scales, fp32 fake-quantized [M, K])``, each computed only
        when asked (``packed`` gives the first two, ``fake`` the third). ``u``: the uniform
        draws ``[M, K]`` fp32 of stochastic rounding, or None."""
        m, k = x.shape
        rows = -(-m // bm)
        data = torch.empty((m, k // 2), dtype=torch.uint8) if packed else None
        scales = torch.empty((rows, k // 16), dtype=torch.uint8) if packed else None
        deq = torch.empty((m, k), dtype=torch.float32) if fake else None
        rc = self._lib.nf8_nvfp4(
            x.data_ptr(),
            _IN[x.dtype],
            m,
            k,
            bm,
            global_amax,
            u.data_ptr() if u is not None else None,
            self._lut["e4m3"].data_ptr(),
            data.data_ptr() if data is not None else None,
            scales.data_ptr() if scales is not None else None,
            deq.data_ptr() if deq is not None else None,
            self._threads(x.numel()),
        )
        self._check(rc, "nf8_nvfp4")
        return data, (scales.view(torch.float8_e4m3fn) if scales is not None else None), deq


def load(
    simd: bool | None = None,
    cxx: str | None = None,
    directory: Path | None = None,
    defines: tuple[str, ...] = (),
) -> CpuKernels:
    """Build (or find in the cache) and load a library variant; raises on failure."""
    path, _ = build(simd, cxx, directory, defines)
    return CpuKernels(path)


def kernels() -> CpuKernels | None:
    """The process's library, built on first use; None when disabled or unavailable."""
    if not enabled():
        return None
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            try:
                path, seconds = build()
                _state["lib"] = CpuKernels(path)
                _state["path"], _state["build_s"] = str(path), seconds
            except Exception as exc:  # no compiler, a failed build, an unloadable library
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    "nemo_fp8_plugin.numerics: the CPU quantization kernels are unavailable "
                    f"({_state['error'][:300]}); using the compiled or eager path "
                    "(slower, same results)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            _state["tried"] = True
    return _state["lib"]


def status() -> dict:
    """What :func:`kernels` found: ``enabled``, ``loaded``, ``simd_width``, ``path``,
    ``build_s`` (seconds this process spent compiling; 0 for a cache hit; None before the
    first use), ``error``."""
    lib = _state["lib"]
    return {
        "enabled": enabled(),
        "loaded": lib is not None,
        "simd_width": lib.simd_width if lib is not None else None,
        "path": _state["path"],
        "build_s": _state["build_s"],
        "error": _state["error"],
    }


def reset() -> None:
    """Forget the loaded library so that the next :func:`kernels` call tries again (tests)."""
    with _lock:
        _state.update(lib=None, tried=False, error=None, build_s=None, path=None)
