"""The GPU device check behind ``scripts/gpu_check.sh``: one H100/H200, within 10 minutes.

Parts, each reported with ``status`` ``ok``, ``failed`` or ``skipped`` (and why), and the
seconds it took:

a. ``quantizers`` (:mod:`.quantizers`): the plugin's quantizers and the emulation's
   fake-quantization on the device, eager and compiled, bit-exact with the CPU reference
   for every recipe, role, input dtype and a set of edge tiles.
b. ``gemm`` (:mod:`.gemm`): FP8 GEMM throughput vs BF16 through torch's ``scaled_mm``
   (tensor-wise, row-wise, block scales), each result checked against the dequantized product.
c. ``refit`` (:mod:`.refit`): the trainer-side refit quantizer's bandwidth next to a same-run
   device copy, and bit-exact with the CPU reference.
d. ``te_quantizers``, e. ``te_linear`` (:mod:`.te`): Transformer Engine's block quantizers
   against the reference, and TE linear layers per recipe against BF16 (where TE imports).
f. ``vllm_refit`` (:mod:`.vllm`): a tiny vLLM engine in block FP8 with an FP8 KV cache,
   refit twice (where vLLM is installed; ``scripts/gpu_vllm_refit.py`` in a child process).

Needs only torch (and Triton for the compiled path): no PyYAML (:mod:`.presets`), no
omegaconf, no host, no network; the TE and vLLM parts say why they were skipped where those
are missing. The whole check keeps to ``--budget`` seconds (:class:`.result.Deadline`):
the quantizers stop when their share is spent, the vLLM part is skipped when too little is
left, and a part that would start after the budget is skipped with that reason. Every part
runs on CPU tensors too (``--device cpu``), which is how the tests cover this package.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

import torch

from ..harness import Stopwatch, environment, write_json
from .gemm import check_gemm
from .quantizers import check_quantizers, edge_inputs
from .refit import check_refit
from .result import Deadline, skipped
from .te import check_te_linear, check_te_quantizers
from .vllm import MIN_SECONDS, TIMEOUT_S, check_vllm_refit

__all__ = [
    "run_checks",
    "main",
    "PARTS",
    "BUDGET_S",
    "QUANTIZER_SHARE",
    "check_quantizers",
    "check_gemm",
    "check_refit",
    "check_te_quantizers",
    "check_te_linear",
    "check_vllm_refit",
    "edge_inputs",
]

PARTS = ("quantizers", "gemm", "refit", "te_quantizers", "te_linear", "vllm_refit")
"""The parts, in the order they run."""

BUDGET_S = 570.0
"""Default ``--budget``: 9.5 minutes, leaving the interpreter's start-up and the imports
inside the promised 10."""

QUANTIZER_SHARE = 0.4
"""Share of the time left that the quantizers part may use: its first run on a GPU compiles
one kernel per tile shape, format and dtype, the one cost that depends on the machine."""


def _vllm_part(device: torch.device, deadline: Deadline) -> dict[str, Any]:
    left = deadline.left()
    if left < MIN_SECONDS:
        return skipped(
            f"only {left:.0f} s of the time budget left; a vLLM engine start "
            f"needs {MIN_SECONDS:.0f} s"
        )
    return check_vllm_refit(device, timeout_s=min(TIMEOUT_S, left - 5))


def run_checks(
    device: str | torch.device = "cuda",
    parts=PARTS,
    *,
    quick: bool = False,
    budget_s: float = BUDGET_S,
) -> dict[str, Any]:
    """Run the named parts within ``budget_s`` seconds; a part that raises is recorded as
    failed and the rest still run. Returns the report ``--out`` holds."""
    device = torch.device(device)
    deadline = Deadline(budget_s)
    report: dict[str, Any] = {"environment": environment(device), "budget_s": budget_s, "parts": {}}
    try:
        from .presets import check_recipes

        report["recipes"] = check_recipes()[1]
    except Exception as exc:  # a broken entry-point recipe: the parts that need one fail
        report["recipes"] = f"not loadable: {type(exc).__name__}: {exc}"
    runners = {
        "quantizers": lambda: check_quantizers(
            device, quick=quick, deadline=deadline.share(QUANTIZER_SHARE)
        ),
        "gemm": lambda: check_gemm(device, sizes=(1024,) if quick else (4096, 8192)),
        "refit": lambda: check_refit(device, quick=quick),
        "te_quantizers": lambda: check_te_quantizers(device),
        "te_linear": lambda: check_te_linear(device),
        "vllm_refit": lambda: _vllm_part(device, deadline),
    }
    with Stopwatch() as whole:
        for name in parts:
            with Stopwatch() as part:
                if deadline.passed():
                    result = skipped(
                        f"the time budget ({budget_s:g} s) was spent before this part started"
                    )
                else:
                    try:
                        result = runners[name]()
                    except Exception as exc:
                        result = {
                            "status": "failed",
                            "reason": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:],
                        }
            result["seconds"] = round(part.seconds, 2)
            report["parts"][name] = result
            print(
                f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)" + _why(result),
                file=sys.stderr,
                flush=True,
            )
    report["seconds"] = round(whole.seconds, 2)
    return report


def _why(result: dict) -> str:
    """The progress line's tail: why a part was skipped or failed, or what it left undone."""
    if "incomplete" in result:
        return f" ({result['incomplete']})"
    if result["status"] != "ok" and result.get("reason"):
        return f": {result['reason']}"
    return ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_fp8_plugin.tools.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default="gpu_check.json", help="JSON results file")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (logic check)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (logic check)")
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        metavar="SECONDS",
        help=f"time the whole check may take (default {BUDGET_S:g})",
    )
    return parser


def _refuse(message: str) -> int:
    print(f"gpu_check: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 when no part failed, 1 when one did, 2 for a mistake in the arguments."""
    args = _parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts:
        return _refuse(f"--parts names no part; choose from {', '.join(PARTS)}")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        return _refuse(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not args.budget > 0:
        return _refuse(f"--budget must be a positive number of seconds, got {args.budget:g}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        return _refuse(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        return _refuse("--device cuda: no CUDA device here; use --device cpu for a logic check")
    from ..._io import check_output_file
    from ...errors import FP8ConfigError

    try:
        check_output_file(args.out, "--out")
    except FP8ConfigError as err:
        return _refuse(str(err))
    report = run_checks(device, parts, quick=args.quick, budget_s=args.budget)
    write_json(args.out, report)
    print(f"[gpu_check] wrote {args.out}", file=sys.stderr)
    failed = [n for n, r in report["parts"].items() if r["status"] == "failed"]
    return 1 if failed else 0
