"""rollout_correction against verl's and slime's own code (property-based).

verl 0.9.1 (Apache-2.0) is downloaded, not installed, by ``scripts/install.sh test`` into
``.cache/upstream``; its ``verl/trainer/ppo/rollout_corr_helper.py`` imports verl's
DataProto and config classes, so the reference functions are taken from the file by
``ast`` and run with verl's own ``masked_sum`` / ``masked_mean`` (also by ``ast``, from
``verl/utils/torch_functional.py``) and its real metric helpers. slime is not on the
registry: ``tests/fixtures/slime/mis.py`` (THUDM/slime at cfab168, Apache-2.0, NOTICE
beside it) is loaded by path.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import types
import zipfile
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, UPSTREAM, shared_nemo_rl
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl.rollout_correction import (
    VERL_RS_OPTIONS,
    divergence,
    nemo_rl_loss_keys,
    slime_mis_weights,
    verl_is_weights,
    verl_rejection_mask,
)

VERL_WHEEL = "verl-0.9.1-py3-none-any.whl"
VERL_HELPER = "verl/trainer/ppo/rollout_corr_helper.py"
VERL_TORCH_F = "verl/utils/torch_functional.py"


def _functions(source: str, names: set[str]) -> ast.Module:
    tree = ast.parse(source)
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            keep.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                keep.append(node)
    assert {getattr(n, "name", None) for n in keep if isinstance(n, ast.FunctionDef)} <= names
    return ast.Module(body=keep, type_ignores=[])


def _exec(module: ast.Module, namespace: dict, filename: str) -> dict:
    exec(compile(module, filename, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def verl():
    wheel = UPSTREAM / VERL_WHEEL
    if not wheel.exists():
        raise RuntimeError(f"{VERL_WHEEL} not in {UPSTREAM}; run `bash scripts/install.sh test`")
    with zipfile.ZipFile(wheel) as zf:
        helper = zf.read(VERL_HELPER).decode()
        torch_f = zf.read(VERL_TORCH_F).decode()
    verl_f = types.SimpleNamespace(
        **{
            k: v
            for k, v in _exec(
                _functions(torch_f, {"masked_sum", "masked_mean"}),
                {"torch": torch},
                VERL_TORCH_F,
            ).items()
            if k in ("masked_sum", "masked_mean")
        }
    )
    wanted = {
        "SAFETY_BOUND",
        "SUPPORTED_ROLLOUT_RS_OPTIONS",
        "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
        "_parse_rollout_is_threshold",
        "_parse_rollout_rs_thresholds",
        "compute_rollout_rejection_mask",
        "compute_rollout_correction_weights",
    }
    from typing import Any, Optional

    # verl's metric helpers are replaced by empty ones: the weights and masks are compared,
    # not the logged metrics, and verl's compute_is_metrics divides by zero on some
    # small batches (a metrics-only fault, rollout_corr_helper.py:758).
    def no_metrics(**_kw):
        return {}

    ns = {
        "torch": torch,
        "math": math,
        "verl_F": verl_f,
        "Optional": Optional,
        "Any": Any,
        "compute_is_metrics": no_metrics,
        "compute_rs_metrics": no_metrics,
    }
    return _Reference(**_exec(_functions(helper, wanted), ns, VERL_HELPER))


class _Reference(types.SimpleNamespace):
    def __repr__(self) -> str:  # hypothesis prints fixtures on failure
        return "<verl reference>"


@pytest.fixture(scope="module")
def slime():
    path = FIXTURES / "slime" / "mis.py"
    spec = importlib.util.spec_from_file_location("slime_mis_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _Reference(compute_mis_weights=module.compute_mis_weights)


def test_our_verl_option_list_is_verls(verl):
    assert set(VERL_RS_OPTIONS) == verl.SUPPORTED_ROLLOUT_RS_OPTIONS


# ------------------------------------------------------------------ inputs

_lp = st.floats(-4.0, 0.0, allow_nan=False)
_noise = st.floats(-0.6, 0.6, allow_nan=False)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    train = torch.tensor(
        draw(st.lists(st.lists(_lp, min_size=t, max_size=t), min_size=b, max_size=b)),
        dtype=torch.float64,
    )
    noise = torch.tensor(
        draw(st.lists(st.lists(_noise, min_size=t, max_size=t), min_size=b, max_size=b)),
        dtype=torch.float64,
    )
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)),
        dtype=torch.float64,
    )
    mask[0, 0] = 1.0  # verl refuses a batch without a valid token
    return train, train - noise, mask


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ verl


@settings(max_examples=120, deadline=None)
@given(
    batch=batches(),
    level=st.sampled_from(["token", "sequence"]),
    window=st.sampled_from([(2.0, None), (1.2, None), (1.5, 0.7), (5.0, 0.5)]),
    normalize=st.booleans(),
)
def test_is_weights_equal_verls(verl, batch, level, window, normalize):
    train, rollout, mask = batch
    high, low = window
    spec = high if low is None else f"{low}_{high}"
    # verl takes a distributed mean when a process group is up (another test may have left
    # one); ours is the single-process mean, so verl is run as a single process.
    with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
        ref, _ = verl.compute_rollout_correction_weights(
            train - rollout,
            mask,
            rollout_is=level,
            rollout_is_threshold=spec,
            rollout_is_batch_normalize=normalize,
        )
    ours = verl_is_weights(train, rollout, mask, level, high, low, batch_normalize=normalize)
    _same(ours, ref)


@settings(max_examples=150, deadline=None)
@given(
    batch=batches(),
    options=st.lists(st.sampled_from(sorted(VERL_RS_OPTIONS)), min_size=1, max_size=3, unique=True),
    bound=st.sampled_from([0.05, 0.2, 1.5, 3.0]),
)
def test_rejection_mask_equals_verls(verl, batch, options, bound):
    train, rollout, mask = batch
    thresholds = [(1.0 / (1 + bound), 1 + bound) if o.endswith("k1") else bound for o in options]
    spec = ",".join(f"{t[0]}_{t[1]}" if isinstance(t, tuple) else str(t) for t in thresholds)
    ref, _ = verl.compute_rollout_rejection_mask(
        train - rollout, mask, rollout_rs=",".join(options), rollout_rs_threshold=spec
    )
    ours = verl_rejection_mask(train, rollout, mask, options, thresholds)
    assert torch.equal(ours, ref)


def test_a_k1_single_bound_means_the_reciprocal_window_as_verl():
    # exp(r) = 1.3 > 1.25: out of (0.8, 1.25) either way round
    train = torch.tensor([[math.log(1.3), 0.0]], dtype=torch.float64)
    rollout = torch.zeros_like(train)
    mask = torch.ones_like(train)
    out = verl_rejection_mask(train, rollout, mask, ["token_k1"], [1.25])
    assert out.tolist() == [[0.0, 1.0]]


# ------------------------------------------------------------------ slime


def _slime_args(**kw):
    base = dict(
        use_tis=True,
        tis_level="token",
        tis_mode="truncate",
        tis_upper_bound=2.0,
        tis_lower_bound=None,
        use_rs=False,
        rs_level="token",
        rs_lower_bound=None,
        rs_upper_bound=None,
        rs_trust_region=None,
        rs_tr_threshold=None,
        tis_batch_normalize=False,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@settings(max_examples=150, deadline=None)
@given(
    batch=batches(),
    level=st.sampled_from(["token", "sequence", "geometric"]),
    mode=st.sampled_from(["truncate", "clip", "mask"]),
    high=st.sampled_from([1.1, 2.0, 5.0]),
    rs_level=st.sampled_from([None, "token", "sequence", "geometric"]),
    trust=st.sampled_from([None, ("max", 0.02), ("avg", 0.01)]),
    normalize=st.booleans(),
)
def test_mis_weights_equal_slimes(slime, batch, level, mode, high, rs_level, trust, normalize):
    train, rollout, mask = batch
    if normalize and level == "geometric":
        normalize = False  # refused by both (tested below)
    if rs_level is None:
        trust = None  # slime reads rs_trust_region only with use_rs; ours takes it alone too
    args = _slime_args(
        tis_level=level,
        tis_mode=mode,
        tis_upper_bound=high,
        use_rs=rs_level is not None,
        rs_level=rs_level or "token",
        rs_trust_region=trust[0] if trust else None,
        rs_tr_threshold=trust[1] if trust else None,
        tis_batch_normalize=normalize,
    )
    ref_w, ref_m, _ = slime.compute_mis_weights(
        args, train_log_probs=list(train), rollout_log_probs=list(rollout), loss_masks=list(mask)
    )
    w, m = slime_mis_weights(
        train,
        rollout,
        mask,
        level,
        mode,
        high,
        rs_level=rs_level,
        trust_region=trust[0] if trust else None,
        trust_region_threshold=trust[1] if trust else None,
        batch_normalize=normalize,
    )
    _same(w, torch.stack(ref_w))
    assert torch.equal(m, torch.stack(ref_m).to(m.dtype))


def test_geometric_batch_normalization_is_refused_as_slime_does(slime):
    train = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="Unsupported tis_level"):
        slime.compute_mis_weights(
            _slime_args(tis_level="geometric", tis_batch_normalize=True),
            train_log_probs=list(train),
            rollout_log_probs=list(train),
            loss_masks=list(mask),
        )
    with pytest.raises(FP8ConfigError) as err:
        slime_mis_weights(train, train, mask, "geometric", batch_normalize=True)
    assert err.value.key == "batch_normalize"


def test_estimators_are_verls_k1_k2_k3():
    r = torch.tensor([-0.5, 0.0, 0.3], dtype=torch.float64)
    assert torch.equal(divergence(r, "k1"), -r)
    assert torch.equal(divergence(r, "k2"), 0.5 * r**2)
    assert torch.equal(divergence(r, "k3"), torch.exp(r) - 1 - r)
    with pytest.raises(FP8ConfigError):
        divergence(r, "k4")


# ------------------------------------------------------------------ NeMo RL keys


def _nemo_rl_config_fields() -> set[str]:
    src = shared_nemo_rl("src/nemo_rl/algorithms/loss/loss_functions.py")
    tree = ast.parse(src.read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ClippedPGLossConfig"
    )
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {},
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
            },
        ),
        (
            {"mode": "clip", "ratio_max": 4.0},
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 4.0,
                "truncated_importance_sampling_ratio_min": 0.25,
            },
        ),
        (
            {"mode": "icepop", "ratio_max": 5.0, "ratio_min": 0.5},
            {
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 5.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
        ),
        (
            {"mode": "none", "rs_level": "geometric", "ratio_max": 1.002, "ratio_min": 0.999},
            {
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.002,
                "truncated_importance_sampling_ratio_min": 0.999,
            },
        ),
        (
            {"level": "sequence"},
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            },
        ),
    ],
)
def test_nemo_rl_keys_are_keys_nemo_rl_declares(kwargs, expected):
    keys = nemo_rl_loss_keys(**kwargs)
    assert keys == {"use_importance_sampling_correction": True, **expected}
    assert set(keys) <= _nemo_rl_config_fields()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mode": "mask"}, "mode"),
        ({"level": "geometric"}, "level"),
        ({"rs_level": "token"}, "rs_level"),
        ({"batch_normalize": True}, "batch_normalize"),
        ({"trust_region": "max"}, "trust_region"),
        ({"rejection": ["seq_mean_k3"]}, "rejection"),
    ],
)
def test_what_nemo_rl_cannot_express_is_refused_naming_the_key(kwargs, key):
    with pytest.raises(FP8ConfigError) as err:
        nemo_rl_loss_keys(**kwargs)
    assert err.value.key == key
    assert "NeMo RL" in str(err.value)
