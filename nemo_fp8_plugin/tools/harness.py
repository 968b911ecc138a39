"""What every tool shares: timing with device sync, the environment record, arm records, and
JSON / PNG output.

``bench``, ``gpu_check``, ``demo`` and ``rl-check`` measure things and write them down; a
figure is only worth its record if it says how it was timed and on what. So they all time
through :func:`timed` / :class:`Stopwatch` (which wait for the device: CUDA work is
asynchronous, and a timer read before ``torch.cuda.synchronize`` measures the launch, not the
work), describe the machine with :func:`environment`, keep per-arm results in
:class:`ArmRecord`, state ratios against a baseline of the same run with :func:`ratio`, and
write files through :func:`write_json` / :func:`write_png` (temp file + rename, so an
interrupted run never leaves half a file).

torch is imported inside the functions that need it: the CLI imports this module before any
work starts.
"""

from __future__ import annotations

import io
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from .._io import atomic_write_bytes, atomic_write_text, dump_json

__all__ = [
    "sync",
    "Stopwatch",
    "timed",
    "interleaved",
    "Progress",
    "stderr_progress",
    "timing_summary",
    "median",
    "ratio",
    "environment",
    "RELEVANT_ENV_PREFIXES",
    "RELEVANT_ENV_NAMES",
    "ArmRecord",
    "write_json",
    "pyplot",
    "write_png",
]

StepT = TypeVar("StepT")


# --------------------------------------------------------------------------- timing


def _cuda(device) -> bool:
    """Whether ``device`` (a ``torch.device``, a string such as ``"cuda:0"``, or None for the
    CPU) is a CUDA device."""
    if device is None:
        return False
    return str(getattr(device, "type", device)).startswith("cuda")


def sync(device=None) -> None:
    """Wait until ``device`` has finished its queued work (a no-op on the CPU)."""
    if _cuda(device):
        import torch

        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall seconds of a ``with`` block, the device synchronized on entry and on exit.

    ``with Stopwatch(device) as sw: work()`` then ``sw.seconds``. For a phase of a loop
    (a step, a refit) rather than a single kernel; :func:`timed` uses CUDA events for those.
    """

    def __init__(self, device=None):
        self.device = device
        self.seconds: float = 0.0
        self._start: float | None = None

    def __enter__(self) -> Stopwatch:
        sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.seconds = time.perf_counter() - self._start


def timed(fn: Callable[[], Any], device=None, *, reps: int = 1, warmup: int = 0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    On a CUDA device each call is bracketed by CUDA events and read after the end event
    completes, so the figure is the device's time for the work, not the host's time to
    launch it; on the CPU it is ``time.perf_counter`` around the call.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        if _cuda(device):
            import torch

            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


Progress = Callable[[str], None]
"""Where a long measurement reports how far it got: called with one line of text per case."""


def stderr_progress(prefix: str) -> Progress:
    """A :data:`Progress` that prints ``prefix: LINE`` on stderr, flushed, one plain line per
    call: no carriage-return redrawing, so a redirected log reads as it was written."""
    import sys

    def report(line: str) -> None:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)

    return report


def interleaved(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    device=None,
    progress: Progress | None = None,
    label: str = "",
) -> dict[str, list[float]]:
    """Each callable once per round, ``reps`` rounds; every timing of each.

    Interleaving puts a figure and its baseline under the same machine load (the project's
    machine is shared): a burst of other work then slows both, not one. ``progress`` gets a
    line per case timed (``label``, round, case, seconds)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(1, reps + 1):
        for name, fn in fns.items():
            times[name] += timed(fn, device)
            if progress is not None:
                progress(f"{label}round {round_}/{reps}, {name}: {times[name][-1]:.3f} s")
    return times


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    values = list(values)
    return statistics.median(values) if values else None


def timing_summary(samples: list[float]) -> dict[str, float]:
    """``best_s`` (the least disturbed run: what the work costs) and ``median_s`` (how much the
    machine's load moved it)."""
    return {"best_s": min(samples), "median_s": statistics.median(samples)}


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, or None when either is missing or the baseline is zero."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


# --------------------------------------------------------------------------- environment


RELEVANT_ENV_PREFIXES = (
    "NVTE_",
    "NEMO_FP8_",
    "VLLM_",
    "TORCHINDUCTOR_",
    "TORCH_COMPILE",
    "CUBLAS",
    "NCCL_",
)
"""Environment variables recorded by :func:`environment`: the ones that change what Transformer
Engine, vLLM, torch.compile or the plugin compute or how fast (TE and vLLM read several at
import)."""

RELEVANT_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CI",
)
"""Further variables recorded by name."""

# A recorded environment ends up in result files that get shared; never copy a credential.
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def _relevant_env() -> dict[str, str]:
    out = {}
    for name in sorted(os.environ):
        if not (name.startswith(RELEVANT_ENV_PREFIXES) or name in RELEVANT_ENV_NAMES):
            continue
        if any(word in name.upper() for word in _SECRET_WORDS):
            continue
        out[name] = os.environ[name]
    return out


def _cpu_name() -> str:
    """The CPU model (``platform.processor()`` is empty on most Linux machines)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _dist_version(name: str) -> str | None:
    """An installed distribution's version without importing it (importing Triton or vLLM
    costs seconds and may touch the GPU)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device=None) -> dict[str, Any]:
    """What a measurement ran on: versions (plugin, Python, torch, CUDA, Triton), the CPU and
    torch's thread count and vector ISA, the GPU when ``device`` is a CUDA device, and the
    environment variables of :data:`RELEVANT_ENV_PREFIXES` / :data:`RELEVANT_ENV_NAMES`."""
    import torch

    from .._version import __version__

    info: dict[str, Any] = {
        "plugin": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _dist_version("triton"),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "device": "cpu" if device is None else str(device),
    }
    if _cuda(device):
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 2**30, 1),
        )
    info["env"] = _relevant_env()
    return info


# --------------------------------------------------------------------------- arm records


@dataclass
class ArmRecord(Generic[StepT]):
    """One arm of a same-run comparison: a named run whose figures are set against a
    baseline arm measured in the same process (the demo's BF16 arm, rl-check's ``bf16``).

    Subclasses add what their arm measures at the end (a held-out loss, a final reward).
    """

    name: str
    """The arm's name: ``bf16`` or a recipe name (demo), an arm of rl-check."""
    steps: list[StepT] = field(default_factory=list)
    """Per-step records, in order (a number or a dataclass per optimizer step)."""
    step_seconds: list[float] = field(default_factory=list)
    """Wall seconds of each step, device-synchronized."""
    completed: bool = False
    """False while the arm runs and when it was stopped before its last step."""

    def series(self, attr: str) -> list[Any]:
        """``attr`` of every step record."""
        return [getattr(step, attr) for step in self.steps]

    def mean(self, attr: str) -> float:
        """Mean of ``attr`` over the steps (NaN for no steps)."""
        values = self.series(attr)
        return sum(values) / len(values) if values else float("nan")

    def tail_mean(self, attr: str, frac: float = 0.25) -> float:
        """Mean of ``attr`` over the last ``frac`` of the steps (at least one; NaN for none):
        where a training curve has settled."""
        values = self.series(attr)
        if not values:
            return float("nan")
        tail = values[-max(1, int(len(values) * frac)) :]
        return sum(tail) / len(tail)

    def steady_step_s(self, warmup: int = 5) -> float | None:
        """Median step time after the first ``warmup`` steps (at most half of them), which
        carry one-off allocation and compilation; None before any step."""
        times = self.step_seconds
        return median(times[min(warmup, len(times) // 2) :]) if times else None


# --------------------------------------------------------------------------- output


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, atomically (values JSON lacks, such as paths,
    are written as strings)."""
    return atomic_write_text(path, dump_json(data))


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed). Call it before
    long work: a missing matplotlib should fail at the start, not when results are ready."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(path: str | os.PathLike, fig, **savefig) -> Path:
    """Render a matplotlib figure to PNG at ``path`` atomically, then close it."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", **savefig)
    finally:
        pyplot().close(fig)  # pyplot keeps every open figure alive until it is closed
    return atomic_write_bytes(path, buf.getvalue())
