"""Compare the weights a generation engine holds after a refit with the weights it should hold.

The comparison behind ``nemo-fp8 verify-refit`` (:mod:`nemo_fp8_plugin.rl.verify`) and the
vLLM method's opt-in check after each refit: one weight at a time, FP8 codes and scales
against the codes and scales the trainer's weight quantizes to, tile by tile.

A weight is

* ``bit_equal``: every code and every scale bit for bit;
* ``within_ulp``: not bit-equal, but every tile that differs does so only as two faithful
  implementations of ``scale = 448 / amax`` differ: its stored fp32 ``scale_inv`` within
  :data:`SCALE_ULPS` ulps of the expected one and every code within one E4M3 step of the
  expected code (sign equal), all of the tile's differing codes moved the same way and the
  way its scale moved (a smaller ``scale_inv`` is a larger multiplying scale: magnitudes up,
  never down). NeMo RL's vLLM worker computes the scale as
  ``reciprocal(amax) * 448`` where Transformer Engine divides: the multiplying scales differ
  by one fp32 ulp in about a quarter of the tiles, the stored reciprocals by one or two ulps
  (measured on random bf16 weights: 17% of tiles at one ulp or more, 2.7% at two), and the
  codes of those tiles by at most one step where a product sits on a rounding boundary. E8M0
  (MXFP8) scales are powers of two: any difference there is a factor of two, never this;
* ``different``: anything else (a code two steps off, a scale off by more, another shape or
  dtype, a high-precision weight where FP8 was expected or the reverse), with the worst tile;
* ``missing``: one side does not hold the weight.

Imports only torch and :mod:`nemo_fp8_plugin.errors`.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import FP8ConfigError

__all__ = [
    "SCALE_ULPS",
    "STATUSES",
    "TileDiff",
    "WeightCheck",
    "compare_high_precision",
    "compare_quantized",
    "missing_weight",
]

SCALE_ULPS = 2
"""Largest distance, in fp32 ulps, between a tile's stored ``scale_inv`` and the expected one
that ``within_ulp`` allows (the multiplying scales of the two quantizers differ by at most
one ulp; their reciprocals, as stored, by at most two)."""

STATUSES = ("bit_equal", "within_ulp", "different", "missing")
"""A weight's verdict, best first; the first two pass."""

_BAND_ELEMENTS = 1 << 24
"""Elements compared at once (a band of whole tile rows): bounds the temporaries to a few
hundred MB whatever the weight's size."""

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

_COMPARE_CHUNK = 1 << 24
"""Bytes compared at once on the CPU (two copies of this size are alive at a time)."""


@dataclass(frozen=True)
class TileDiff:
    """One tile of an FP8 weight that differs from the expected one.

    Attributes:
        tile: its index ``(tile row, tile column)``.
        rows, cols: the element ranges it covers, ``[start, stop)``.
        codes_differing: how many of its FP8 codes differ.
        scale_engine, scale_expected: its ``scale_inv`` on each side (as floats).
        scale_ulps: the distance of the two fp32 scales in ulps; None for E8M0 scales or a
            non-finite one.
        max_abs_diff: the largest ``|dequantized engine - dequantized expected|`` in the tile
            (inf where one side is NaN or inf and the other not).
    """

    tile: tuple[int, int]
    rows: tuple[int, int]
    cols: tuple[int, int]
    codes_differing: int
    scale_engine: float
    scale_expected: float
    scale_ulps: int | None
    max_abs_diff: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WeightCheck:
    """The verdict on one weight (Hugging Face name).

    Attributes:
        name: the weight's name (``model.layers.3.mlp.down_proj.weight``).
        status: one of :data:`STATUSES`.
        kind: ``"fp8"`` (codes and scales compared) or ``"high_precision"``.
        tiles: number of scale tiles (FP8) or elements (high precision) compared.
        tiles_within_ulp: tiles that differ within the allowed scale difference.
        tiles_different: tiles (or elements) that differ otherwise.
        worst: the tile that differs most (FP8): among the different tiles if any, else
            among those within the scale difference; None when bit-equal.
        max_abs_diff: the largest dequantized difference over the whole weight.
        detail: one line saying what differs, or why the weight could not be compared.
    """

    name: str
    status: str
    kind: str
    tiles: int = 0
    tiles_within_ulp: int = 0
    tiles_different: int = 0
    worst: TileDiff | None = None
    max_abs_diff: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True for ``bit_equal`` and ``within_ulp``."""
        return self.status in ("bit_equal", "within_ulp")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["worst"] = None if self.worst is None else self.worst.to_dict()
        return out


def missing_weight(name: str, kind: str, detail: str) -> WeightCheck:
    """A weight one side does not hold."""
    return WeightCheck(name=name, status="missing", kind=kind, detail=detail)


def _different(name: str, kind: str, detail: str) -> WeightCheck:
    return WeightCheck(name=name, status="different", kind=kind, detail=detail)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width (NaN payloads and -0 kept)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape hold the same bytes. On the CPU the bytes are compared
    by ``memcmp`` (``ctypes.string_at`` copies, 16 MiB at a time), single-threaded: measured on
    two loaded cores at 3.7 ms median for 2.9 MB, where ``torch.equal`` took 12-17 ms and an
    int64 ``count_nonzero(x ^ y)`` 1.5 ms at best but 43 ms median (its two OpenMP threads
    wait on each other under load). On a GPU, ``torch.equal``."""
    x, y = _bits(a).reshape(-1), _bits(b).reshape(-1)
    nbytes = x.numel() * x.element_size()
    if nbytes != y.numel() * y.element_size():
        return False
    if x.device.type != "cpu" or y.device.type != "cpu":
        return torch.equal(x, y)
    px, py = x.data_ptr(), y.data_ptr()
    for offset in range(0, nbytes, _COMPARE_CHUNK):
        n = min(_COMPARE_CHUNK, nbytes - offset)
        if ctypes.string_at(px + offset, n) != ctypes.string_at(py + offset, n):
            return False
    return True


def _check_tensor(value: Any, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise FP8ConfigError(f"expected a torch.Tensor, got {type(value).__name__}", key=key)
    return value.detach()


def compare_high_precision(name: str, engine: torch.Tensor, expected: torch.Tensor) -> WeightCheck:
    """A weight the engine holds in high precision: bit for bit against the trainer's, cast to
    the engine's dtype (what loading it does)."""
    engine = _check_tensor(engine, name)
    expected = _check_tensor(expected, name)
    kind = "high_precision"
    if engine.dtype in _FP8:
        return _different(name, kind, "the engine holds FP8 where high precision was expected")
    if tuple(engine.shape) != tuple(expected.shape):
        return _different(
            name,
            kind,
            f"shape {list(engine.shape)} in the engine, {list(expected.shape)} expected",
        )
    want = expected.to(device=engine.device, dtype=engine.dtype)
    if _same(engine, want):
        return WeightCheck(name=name, status="bit_equal", kind=kind, tiles=engine.numel())
    unequal = _bits(engine) != _bits(want)
    n = int(unequal.sum())
    if n == 0:
        return WeightCheck(name=name, status="bit_equal", kind=kind, tiles=engine.numel())
    gap = (engine.double() - want.double()).abs()
    gap = torch.where(unequal & gap.isnan(), torch.full_like(gap, torch.inf), gap)
    gap = torch.where(unequal, gap, torch.zeros_like(gap))
    worst = int(gap.reshape(-1).argmax())
    where = list(torch.unravel_index(torch.tensor(worst), engine.shape)) if engine.dim() else []
    return WeightCheck(
        name=name,
        status="different",
        kind=kind,
        tiles=engine.numel(),
        tiles_different=n,
        max_abs_diff=float(gap.reshape(-1)[worst]),
        detail=f"{n} of {engine.numel()} elements differ; the largest difference is "
        f"{float(gap.reshape(-1)[worst]):.6g} at {[int(i) for i in where]}",
    )


def _scale_float(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float32)


def compare_quantized(
    name: str,
    engine_data: torch.Tensor,
    engine_scale: torch.Tensor,
    expected_data: torch.Tensor,
    expected_scale: torch.Tensor,
    block: tuple[int, int],
) -> WeightCheck:
    """An FP8 weight ``[N, K]`` and its ``scale_inv`` (fp32 per ``block`` tile, or E8M0)
    against the expected codes and scales, tile by tile (see the module docstring)."""
    tensors = [
        _check_tensor(t, name) for t in (engine_data, engine_scale, expected_data, expected_scale)
    ]
    e_data, e_scale, x_data, x_scale = tensors
    kind = "fp8"
    bm, bn = int(block[0]), int(block[1])
    if e_data.dtype not in _FP8:
        return _different(name, kind, f"the engine holds {e_data.dtype} where FP8 was expected")
    if e_data.dtype != x_data.dtype:
        return _different(name, kind, f"codes are {e_data.dtype}, expected {x_data.dtype}")
    if e_data.dim() != 2 or tuple(e_data.shape) != tuple(x_data.shape):
        return _different(
            name,
            kind,
            f"shape {list(e_data.shape)} in the engine, {list(x_data.shape)} expected",
        )
    m, k = e_data.shape
    tiles_shape = (-(-m // bm), -(-k // bn))
    for side, scale in (("the engine's", e_scale), ("the expected", x_scale)):
        if tuple(scale.shape) != tiles_shape:
            return _different(
                name,
                kind,
                f"{side} scales have shape {list(scale.shape)}, {list(tiles_shape)} for "
                f"{bm}x{bn} tiles of {[m, k]}",
            )
    if e_scale.dtype != x_scale.dtype:
        return _different(name, kind, f"scales are {e_scale.dtype}, expected {x_scale.dtype}")
    device = e_data.device
    x_data, x_scale = x_data.to(device), x_scale.to(device)
    ntiles = tiles_shape[0] * tiles_shape[1]
    if _same(e_data, x_data) and _same(e_scale, x_scale):
        return WeightCheck(name=name, status="bit_equal", kind=kind, tiles=ntiles)

    fp32_scales = e_scale.dtype == torch.float32
    band_rows = max(1, _BAND_ELEMENTS // max(1, bm * tiles_shape[1] * bn))
    near_tiles = diff_tiles = 0
    worst: TileDiff | None = None
    worst_key: tuple[bool, float, int] | None = None
    max_gap = 0.0
    for t0 in range(0, tiles_shape[0], band_rows):
        t1 = min(tiles_shape[0], t0 + band_rows)
        band = _compare_band(
            e_data[t0 * bm : t1 * bm],
            x_data[t0 * bm : t1 * bm],
            e_scale[t0:t1],
            x_scale[t0:t1],
            bm,
            bn,
            fp32_scales,
        )
        near, different, codes, gap, ulps = band
        near_tiles += int(near.sum())
        diff_tiles += int(different.sum())
        max_gap = max(max_gap, float(gap.max()))
        flagged = near | different
        if not bool(flagged.any()):
            continue
        # the worst of this band: a different tile before a near one, then the larger gap
        pool = different if bool(different.any()) else near
        score = torch.where(pool, gap, torch.full_like(gap, -1.0))
        i, j = divmod(int(score.reshape(-1).argmax()), gap.shape[1])
        key = (bool(different[i, j]), float(gap[i, j]), int(codes[i, j]))
        if worst_key is None or key > worst_key:
            worst_key = key
            ti = t0 + i
            worst = TileDiff(
                tile=(ti, j),
                rows=(ti * bm, min(m, (ti + 1) * bm)),
                cols=(j * bn, min(k, (j + 1) * bn)),
                codes_differing=int(codes[i, j]),
                scale_engine=float(_scale_float(e_scale[ti, j])),
                scale_expected=float(_scale_float(x_scale[ti, j])),
                scale_ulps=None if ulps is None or ulps[i, j] < 0 else int(ulps[i, j]),
                max_abs_diff=float(gap[i, j]),
            )
    status = "different" if diff_tiles else ("within_ulp" if near_tiles else "bit_equal")
    detail = ""
    if worst is not None:
        what = (
            f"{diff_tiles} of {ntiles} tiles differ"
            + (f" ({near_tiles} more within the scale difference)" if near_tiles else "")
            if diff_tiles
            else f"{near_tiles} of {ntiles} tiles within {SCALE_ULPS} scale ulps and one code step"
        )
        detail = (
            f"{what}; worst tile {worst.tile} (rows "
            f"{worst.rows[0]}-{worst.rows[1] - 1}, columns {worst.cols[0]}-{worst.cols[1] - 1}): "
            f"{worst.codes_differing} codes differ, scale_inv {worst.scale_engine:.9g} vs "
            f"{worst.scale_expected:.9g}, largest difference {worst.max_abs_diff:.6g}"
        )
    return WeightCheck(
        name=name,
        status=status,
        kind=kind,
        tiles=ntiles,
        tiles_within_ulp=near_tiles,
        tiles_different=diff_tiles,
        worst=worst,
        max_abs_diff=max_gap,
        detail=detail,
    )


def _tiles(x: torch.Tensor, rows: int, bm: int, kt: int, bn: int) -> torch.Tensor:
    """``x`` ``[r, K]`` zero-padded to ``[rows * bm, kt * bn]``, viewed ``[rows, bm, kt, bn]``."""
    x = F.pad(x, (0, kt * bn - x.shape[1], 0, rows * bm - x.shape[0]))
    return x.reshape(rows, bm, kt, bn)


def _compare_band(
    e_data: torch.Tensor,
    x_data: torch.Tensor,
    e_scale: torch.Tensor,
    x_scale: torch.Tensor,
    bm: int,
    bn: int,
    fp32_scales: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per tile of a band: (within the scale difference, different, codes differing, largest
    dequantized gap, scale distance in ulps or -1 / None)."""
    rows, kt = e_scale.shape
    e_codes = _tiles(_bits(e_data).to(torch.int16), rows, bm, kt, bn)
    x_codes = _tiles(_bits(x_data).to(torch.int16), rows, bm, kt, bn)
    unequal = e_codes != x_codes
    codes = unequal.sum(dim=(1, 3))

    e_val = _tiles(e_data.float(), rows, bm, kt, bn)
    x_val = _tiles(x_data.float(), rows, bm, kt, bn)
    finite = e_val.isfinite() & x_val.isfinite()
    same_sign = (e_codes & 0x80) == (x_codes & 0x80)
    one_step = (e_codes - x_codes).abs() <= 1
    codes_near = (~unequal | (finite & same_sign & one_step)).all(dim=3).all(dim=1)
    # one tile, one scale: a larger multiplying scale can only round a magnitude up, a smaller
    # one only down, so the codes of a tile all move one way, the way its scale_inv says
    moved = torch.where(unequal, (e_codes & 0x7F) - (x_codes & 0x7F), torch.zeros_like(e_codes))
    up = (moved > 0).any(dim=3).any(dim=1)
    down = (moved < 0).any(dim=3).any(dim=1)

    es, xs = _scale_float(e_scale), _scale_float(x_scale)
    codes_near &= ~(up & down) & ~((es < xs) & down) & ~((es > xs) & up)
    scale_equal = _bits(e_scale) == _bits(x_scale)
    ulps = None
    if fp32_scales:
        eb, xb = _bits(e_scale).long(), _bits(x_scale).long()
        comparable = es.isfinite() & xs.isfinite() & ((eb < 0) == (xb < 0))
        ulps = torch.where(comparable, (eb - xb).abs(), torch.full_like(eb, -1))
        scale_near = comparable & (ulps <= SCALE_ULPS)
    else:
        scale_near = scale_equal
    equal = scale_equal & (codes == 0)
    near = ~equal & scale_near & codes_near & bool(fp32_scales)
    different = ~equal & ~near

    deq_e = e_val * es[:, None, :, None]
    deq_x = x_val * xs[:, None, :, None]
    gap = (deq_e - deq_x).abs()
    same = (~unequal) & scale_equal[:, None, :, None]
    gap = torch.where(same, torch.zeros_like(gap), gap)
    gap = torch.where(gap.isnan(), torch.full_like(gap, torch.inf), gap)
    return near, different, codes, gap.amax(dim=(1, 3)), ulps
