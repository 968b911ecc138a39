"""The emulated linear on the C++ fake quantizers, and its weight cache.

Every recipe's fprop/dgrad/wgrad through the C++ kernels (the default on a CPU) is held to
the eager reference (``fused_mode(False)``) bit for bit: outputs, input and weight
gradients, over several optimizer steps (delayed scaling's state evolves across them). The
weight cache (one fake quantization of a weight per optimizer step, reused by every
micro-batch) gives the same bits as no cache and is invalidated by an optimizer step and by
in-place writes.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.numerics import FP8EmulatedLinear, _cpu, clear_weight_cache, fused_mode
from nemo_fp8_plugin.numerics import linear as L
from presets import FP8_PRESETS, preset_names

RECIPES = preset_names()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count calls into the loaded C++ library's fake quantizers."""
    monkeypatch.delenv("NEMO_FP8_CPU_KERNEL", raising=False)
    lib = _cpu.kernels()
    assert lib is not None, _cpu.status()["error"]  # g++ is required in CI: never skipped
    calls: list[str] = []
    for name in ("fake_quant_tiles", "fake_quant_scaled", "nvfp4"):
        real = getattr(lib, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(lib, name, spy)
    return calls


def train(recipe: str, *, fused: bool, steps: int = 3, micro: int = 2, dtype=torch.float32):
    """A 256 -> 384 layer trained ``steps`` optimizer steps of ``micro`` micro-batches;
    returns every output and gradient, in order."""
    torch.manual_seed(0)  # NVFP4's stochastic rounding draws from the default generator
    layer = FP8EmulatedLinear(256, 384, recipe=get_recipe(recipe))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(384, 256, generator=g) * 0.05)
        layer.bias.copy_(torch.randn(384, generator=g))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    seen = []
    with fused_mode(fused):
        for _ in range(steps):
            for _ in range(micro):
                x = (torch.randn(128, 256, generator=g) * 3).to(dtype).requires_grad_()
                y = layer(x)
                y.backward(torch.randn(128, 384, generator=g).to(dtype))
                seen += [y.detach(), x.grad]
            seen += [layer.weight.grad.clone(), layer.bias.grad.clone()]
            opt.step()
            opt.zero_grad()
    return seen


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_on_the_cpu_kernels_matches_the_reference(recipe, kernel_calls):
    want = train(recipe, fused=False)
    assert kernel_calls == []  # the eager reference really was eager
    got = train(recipe, fused=True)
    assert kernel_calls  # and the fused run really ran the C++ kernels
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "recipe", preset_names(lambda row: row.tiled)
)  # the kinds with CPU kernels
def test_bf16_activations_on_the_cpu_kernels_match_the_reference(recipe, kernel_calls):
    want = train(recipe, fused=False, steps=1, dtype=torch.bfloat16)
    got = train(recipe, fused=True, steps=1, dtype=torch.bfloat16)
    assert kernel_calls
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_cache_gives_the_uncached_bits(recipe, monkeypatch):
    cached = train(recipe, fused=True, micro=3)
    monkeypatch.setenv("NEMO_FP8_WEIGHT_CACHE", "0")
    uncached = train(recipe, fused=True, micro=3)
    for a, b in zip(cached, uncached):
        assert torch.equal(a, b)


def _weight_casts(layer, monkeypatch) -> list[int]:
    """Count the weight role's row-wise fake quantizations (cache misses)."""
    q = layer.fp8_emulator.quantizers["weight"]
    count = [0]
    real_rowwise, real_fq = q.rowwise, L.fake_quant_with_scale

    def rowwise(t):
        count[0] += 1
        return real_rowwise(t)

    monkeypatch.setattr(q, "rowwise", rowwise)
    if q.state is not None:  # delayed scaling casts the weight through fake_quant_with_scale

        def fq(t, *args, **kwargs):
            if t.shape == layer.weight.shape:
                count[0] += 1
            return real_fq(t, *args, **kwargs)

        monkeypatch.setattr(L, "fake_quant_with_scale", fq)
    return count


@pytest.mark.parametrize("recipe", FP8_PRESETS)
def test_weight_cast_once_per_optimizer_step(recipe, monkeypatch):
    layer = FP8EmulatedLinear(128, 128, recipe=get_recipe(recipe))
    count = _weight_casts(layer, monkeypatch)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(16, 128)

    def micro_batches(n):
        for _ in range(n):
            layer(x).sum().backward()

    micro_batches(3)
    # delayed scaling: the first micro-batches' amaxes change the scale, which recasts
    first = count[0]
    assert first == 1 or (recipe == "fp8_delayed" and first <= 3)
    opt.step()
    micro_batches(1)
    assert count[0] == first + 1  # the step changed the weight: cast again
    with torch.no_grad():
        layer.weight.add_(1.0)  # an in-place write bumps the version counter
    micro_batches(1)
    assert count[0] == first + 2
    layer.weight.data.mul_(0.5)  # through .data: no version bump, so say so
    clear_weight_cache()
    micro_batches(1)
    assert count[0] == first + 3


def test_weight_key_tracks_storage_version_and_steps(monkeypatch):
    w = torch.nn.Parameter(torch.randn(8, 8))
    k0 = L.weight_key(w, torch.float32)
    assert L.weight_key(w, torch.float32) == k0
    assert L.weight_key(w, torch.bfloat16) != k0  # the compute dtype is part of it
    with torch.no_grad():
        w.mul_(2)
    assert L.weight_key(w, torch.float32) != k0
    k1 = L.weight_key(w, torch.float32)
    torch.optim.SGD([w], lr=0.1).step()  # no grad: nothing written, but a step counts
    assert L.weight_key(w, torch.float32) != k1
    monkeypatch.setenv("NEMO_FP8_WEIGHT_CACHE", "off")
    assert L.weight_key(w, torch.float32) is None
