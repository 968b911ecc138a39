"""Parts d and e, Transformer Engine's own code (only where TE imports: a NeMo container).

d. ``te_quantizers``: TE's ``Float8BlockQuantizer`` (1x128 and 128x128 tiles, fp32 and
   power-of-2 scales, fp32 and bf16 input) against the plugin's reference, bit for bit.
e. ``te_linear``: ``te.Linear`` forward + backward per recipe against the same layer in
   BF16, measured in the same run; a recipe the GPU cannot train is skipped with the
   capability table's reason (:func:`nemo_fp8_plugin.kinds.hardware_problems`).

Both take the TE modules as an argument (:class:`TEModules`, default :func:`import_te`) and
``require_cuda``, so the tests run every line of them on the CPU with stand-ins that follow
TE's documented layouts; TE itself cannot load on a machine without ``libcuda``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..harness import median, ratio, timed
from .result import failed, skipped

__all__ = ["TEModules", "import_te", "unpad_te_scales", "check_te_quantizers", "check_te_linear"]


class TEModules(NamedTuple):
    """What the TE parts use of Transformer Engine."""

    te: Any
    """``transformer_engine.pytorch`` (``Linear``, ``autocast`` or ``fp8_autocast``)."""
    tex: Any
    """``transformer_engine_torch`` (``DType``)."""
    block_quantizer: Any
    """``Float8BlockQuantizer`` (``transformer_engine.pytorch.tensor.float8_blockwise_tensor``)."""
    recipe: Any
    """``transformer_engine.common.recipe`` (the recipe classes
    :func:`nemo_fp8_plugin.hosts.te.build_te_recipe` instantiates)."""


def import_te() -> tuple[TEModules | None, str | None]:
    """TE's modules, or None and why they are not importable here."""
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.common import recipe
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    except Exception as exc:  # without libcuda TE raises OSError/RuntimeError, not ImportError
        why = f"Transformer Engine is not importable here ({type(exc).__name__}: {exc})"
        return None, why[:300]
    return TEModules(te, tex, Float8BlockQuantizer, recipe), None


def _modules(te_modules: TEModules | None) -> tuple[TEModules | None, str | None]:
    return (te_modules, None) if te_modules is not None else import_te()


def unpad_te_scales(
    scale_inv: torch.Tensor, block_dim: int, rows: int, scale_cols: int
) -> torch.Tensor:
    """TE's GEMM-ready block scales in the plain layout of the reference: ``[M, ceil(K/128)]``
    for 1x128 tiles (``block_dim`` 1), ``[ceil(M/128), ceil(K/128)]`` for 128x128 (2).

    TE pads scales for cuBLAS: 1x128 scales are stored transposed as ``[ceil(K/128),
    roundup(M, 4)]``, 128x128 scales as ``[ceil(M/128), roundup(ceil(K/128), 4)]``
    (docs/numerics.md, block scaling). ``rows`` is M, ``scale_cols`` the reference's scale columns."""
    if block_dim == 1:
        return scale_inv[:, :rows].t()
    return scale_inv[:, :scale_cols]


def check_te_quantizers(
    device: torch.device,
    *,
    te_modules: TEModules | None = None,
    require_cuda: bool = True,
    rows: int = 512,
    cols: int = 1024,
) -> dict[str, Any]:
    """Part d (see the module docstring)."""
    mods, why = _modules(te_modules)
    if mods is None:
        return skipped(why)
    if require_cuda and device.type != "cuda":
        return skipped("Transformer Engine's quantizers run on CUDA only")
    from ... import numerics
    from .quantizers import edge_inputs

    out, bad = [], []
    for pow2 in (False, True):
        for dim, tile in ((1, (1, 128)), (2, (128, 128))):
            for dtype in (torch.float32, torch.bfloat16):
                x = edge_inputs(rows, cols, dtype, seed=dim)["random"].to(device)
                q = mods.block_quantizer(
                    mods.tex.DType.kFloat8E4M3,
                    rowwise=True,
                    columnwise=False,
                    force_pow_2_scales=pow2,
                    block_scaling_dim=dim,
                )
                got = q(x)
                ours = numerics.quantize_blockwise(x, block=tile, pow2_scales=pow2)
                te_scales = unpad_te_scales(
                    got._rowwise_scale_inv, dim, rows, ours.scale_inv.shape[1]
                )
                ok = (
                    torch.equal(got._rowwise_data.view(torch.uint8), ours.data.view(torch.uint8))
                    and te_scales.shape == ours.scale_inv.shape
                    and torch.equal(
                        te_scales.contiguous().view(torch.int32),
                        ours.scale_inv.contiguous().view(torch.int32),
                    )
                )
                row = {
                    "tile": list(tile),
                    "pow2": pow2,
                    "dtype": str(dtype).split(".")[-1],
                    "bit_exact": bool(ok),
                }
                out.append(row)
                if not ok:
                    bad.append(row)
    return {"status": "ok" if not bad else "failed", "results": out}


def _autocast(te, recipe):
    """TE's FP8 context for ``recipe``: ``te.autocast(recipe=...)`` in TE >= 2.8,
    ``te.fp8_autocast(fp8_recipe=...)`` before."""
    if getattr(te, "autocast", None) is not None:
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def check_te_linear(
    device: torch.device,
    *,
    n: int = 4096,
    recipes=None,
    te_modules: TEModules | None = None,
    require_cuda: bool = True,
    capability: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Part e (see the module docstring). ``capability``: the GPU's (major, minor), read
    from ``device`` when None."""
    mods, why = _modules(te_modules)
    if mods is None:
        return skipped(why)
    if require_cuda and device.type != "cuda":
        return skipped("Transformer Engine's linear layers run on CUDA only")
    from ...capabilities import arch_of_capability
    from ...hosts.te import build_te_recipe
    from ...kinds import hardware_problems
    from .presets import check_recipes

    specs = check_recipes()[0] if recipes is None else list(recipes)
    major, minor = capability or torch.cuda.get_device_capability(device)
    arch = arch_of_capability(major, minor)
    if arch is None or not arch.fp8:
        return skipped(f"SM {major}.{minor} has no FP8 tensor cores")
    te = mods.te
    layer = te.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(recipe=None):
        if recipe is None:
            y = layer(x)
        else:
            with _autocast(te, recipe):
                y = layer(x)
        y.sum().backward()

    t_bf16 = median(timed(step, device, reps=10, warmup=3))
    results: dict[str, Any] = {"bf16_ms": t_bf16 * 1e3}
    broken = []
    for spec in specs:
        if spec.training != "fp8":
            results[spec.name] = skipped("the recipe trains in BF16")
            continue
        stops = [
            p
            for p in hardware_problems(spec, arch.name)
            if p.level == "error" and p.side in (None, "training")
        ]
        if stops:
            results[spec.name] = skipped(stops[0].message)
            continue
        try:
            recipe = build_te_recipe(spec, mods.recipe)
            t = median(timed(lambda recipe=recipe: step(recipe), device, reps=10, warmup=3))
            results[spec.name] = {"ms": t * 1e3, "speedup_vs_bf16": ratio(t_bf16, t)}
        except Exception as exc:  # one recipe's failure is its row's; the others still run
            results[spec.name] = failed(f"{type(exc).__name__}: {exc}"[:300])
            broken.append(spec.name)
    out: dict[str, Any] = {
        "status": "failed" if broken else "ok",
        "arch": arch.name,
        "results": results,
    }
    if broken:
        out["reason"] = f"TE linear failed under {', '.join(broken)}"
    return out
