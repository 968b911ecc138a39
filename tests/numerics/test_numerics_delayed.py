"""Delayed scaling state vs TE's fused update kernel (kernel_bulk), per NUMERICS.md.

The sequence tests replay random amax streams (with zeros, infs and NaNs) through the
plugin's vectorised state and through the loop-form reference of
``test_numerics_reference.RefDelayedState``; history, scale and scale_inv must match bit
for bit after every step.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from test_numerics_reference import RefDelayedState, ref_tensor_quantize

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import DelayedScalingState, quantize_with_scale


def bits(t) -> np.ndarray:
    return np.asarray(t, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("length", [1, 2, 5, 16])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_sequence_matches_kernel(length, algo, margin, fmt):
    rng = random.Random(length * 31 + margin)
    state = DelayedScalingState(length, algo, margin, fmt)
    ref = RefDelayedState(length, algo, margin, fmt)
    for step in range(60):
        # 0 to 2 casts per step (0 = a step without this tensor: last == 0)
        for _ in range(rng.choice([0, 1, 1, 2])):
            amax = rng.choice(
                [
                    0.0,
                    math.inf,
                    math.nan,
                    1e-39,
                    3e38,
                    rng.uniform(0, 10) * 10 ** rng.randint(-6, 6),
                ]
            )
            state.record_amax(amax)
            ref.record(amax)
        state.update()
        ref.update()
        assert bits(state.amax_history.numpy()).tolist() == bits(ref.hist).tolist(), step
        assert bits(state.scale.numpy()) == bits(ref.scale), step
        assert bits(state.scale_inv.numpy()) == bits(ref.scale_inv), step


def test_roll_and_window_max():
    s = DelayedScalingState(3, "max", 0, "e4m3")
    s.update(2.0)
    assert s.amax_history.tolist() == [0.0, 0.0, 2.0] and float(s.scale) == 224.0
    s.update(4.0)
    assert s.amax_history.tolist() == [0.0, 2.0, 4.0] and float(s.scale) == 112.0
    s.update(1.0)
    assert s.amax_history.tolist() == [0.0, 4.0, 1.0] and float(s.scale) == 112.0
    s.update(1.0)  # 4.0 is in the old window (slot 1) for this update, then drops out
    assert s.amax_history.tolist() == [0.0, 1.0, 1.0] and float(s.scale) == 112.0
    s.update(1.0)
    assert float(s.scale) == 448.0


def test_zero_amax_is_a_no_op():
    s = DelayedScalingState(4, "max", 0, "e4m3")
    s.update(8.0)
    before = s.amax_history.clone()
    s.update()  # nothing recorded: last == 0
    s.update(0.0)
    assert torch.equal(s.amax_history, before) and float(s.scale) == 56.0


def test_inf_freezes_scale_until_it_leaves_the_window():
    s = DelayedScalingState(2, "max", 0, "e4m3")
    s.update(7.0)
    assert float(s.scale) == 64.0
    s.update(math.inf)
    assert float(s.scale) == 64.0  # inf in the window: previous scale kept
    s.update(14.0)
    assert float(s.scale) == 64.0  # still in the old window of this update
    s.update(14.0)
    assert float(s.scale) == 32.0


def test_margin_and_most_recent():
    s = DelayedScalingState(8, "most_recent", 2, "e4m3")
    s.update(100.0)
    s.update(7.0)
    assert float(s.scale) == 448.0 / 4 / 7.0  # 16, from the latest amax only
    e5 = DelayedScalingState(1, "max", 1, "e5m2")
    e5.update(7.0)
    assert float(e5.scale) == 57344.0 / 2 / 7.0


def test_tiny_amax_gives_flt_max():
    s = DelayedScalingState(1, "max", 0, "e4m3")
    s.update(1e-40)
    assert float(s.scale) == torch.finfo(torch.float32).max


def test_amax_recording_max_reduces_and_ignores_nan():
    s = DelayedScalingState(4, "max", 0, "e4m3")
    s.record_amax(3.0)
    s.record_amax(math.nan)
    s.record_amax(2.0)
    assert float(s.amax_history[0]) == 3.0


def test_quantize_uses_the_delayed_scale_and_records():
    s = DelayedScalingState(4, "max", 0, "e4m3")
    x1 = torch.tensor([1.0, -2.0, 0.5])
    q1 = s.quantize(x1)  # step 1: scale 1, amax 2 recorded
    assert float(q1.scale_inv) == 1.0 and float(s.amax_history[0]) == 2.0
    s.update()
    x2 = torch.tensor([100.0, 3.0])
    q2 = s.quantize(x2)  # step 2: scale 448 / 2 from step 1; 100 * 224 saturates
    want, want_sinv = ref_tensor_quantize(x2.numpy(), "e4m3", False, 0.0, scale=np.float32(224.0))
    assert q2.data.view(torch.uint8).numpy().tolist() == want.tolist()
    assert float(q2.scale_inv) == float(want_sinv)
    assert torch.equal(
        q2.data.view(torch.uint8),
        quantize_with_scale(x2, torch.tensor(224.0)).data.view(torch.uint8),
    )


def test_state_dict_round_trip_and_reset():
    s = DelayedScalingState(4, "max", 0, "e4m3")
    s.update(5.0)
    t = DelayedScalingState(4, "max", 0, "e4m3")
    t.load_state_dict(s.state_dict())
    assert torch.equal(t.amax_history, s.amax_history) and torch.equal(t.scale, s.scale)
    t.reset()
    assert float(t.scale) == 1.0 and not t.amax_history.any()
    with pytest.raises(FP8ConfigError, match="amax_history_len"):
        DelayedScalingState(8).load_state_dict(s.state_dict())


def test_bad_settings():
    with pytest.raises(FP8ConfigError, match="amax_compute_algo"):
        DelayedScalingState(4, "mean")
    with pytest.raises(FP8ConfigError, match="amax_history_len"):
        DelayedScalingState(0)
    with pytest.raises(FP8ConfigError, match="margin"):
        DelayedScalingState(4, "max", -1)


def _reduce_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        s = DelayedScalingState(4, "max", 0, "e4m3")
        s.record_amax(2.0 if rank == 0 else 8.0)
        s.all_reduce_amax()
        s.update()
        torch.save({"scale": s.scale, "hist": s.amax_history}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_amax_all_reduce_across_ranks(tmp_path):
    """TE reduce_amax: every rank ends up with the same scale, from the largest amax."""
    import torch.multiprocessing as mp

    mp.spawn(_reduce_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert float(got["scale"]) == 56.0 and got["hist"].tolist() == [0.0, 0.0, 0.0, 8.0]
