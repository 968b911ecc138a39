"""Property tests: whatever mapping a user writes, the loader returns a valid spec or raises
our own error type naming a key. Nothing else escapes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_fp8_plugin import FP8ConfigError, RecipeSpec
from nemo_fp8_plugin.config import find_fp8_request
from nemo_fp8_plugin.errors import one_line
from nemo_fp8_plugin.spec import BF16Rules, ImportanceSampling
from presets import FP8_PRESETS

pytestmark = pytest.mark.torch_free

NAMES = [
    *FP8_PRESETS,
    "fp8_bogus",
    "bfloat16",
    "bf16-mixed",
    "",
]
FIELDS = list(RecipeSpec.OVERRIDABLE) + ["recipe", "model", "pow2", "bf16_layer"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        NAMES
        + [
            "e4m3",
            "hybrid",
            "e5m2",
            "block",
            "mx",
            "delayed",
            "tensorwise",
            "auto",
            "fp8",
            "bf16",
            "h100",
            "b200",
            "max",
            "most_recent",
            "tis",
            "icepop",
            "token",
            "sequence",
            "both",
            "*a_proj*",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(
                st.sampled_from(list(BF16Rules.FIELDS) + list(ImportanceSampling.FIELDS)),
                st.text(max_size=6),
                st.integers(),
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=8,
)
fp8_blocks = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6), st.sampled_from(NAMES), values
)
configs = st.fixed_dictionaries(
    {},
    optional={
        "precision": st.one_of(st.sampled_from(NAMES), values),
        "fp8": fp8_blocks,
        "mixed_precision": st.one_of(st.sampled_from(NAMES), values),
        "policy": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "precision": st.one_of(st.sampled_from(NAMES), values),
                    "model_name": values,
                },
            ),
            values,
        ),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_loader_returns_a_spec_or_names_a_key(cfg):
    try:
        req = find_fp8_request(cfg)
    except FP8ConfigError as err:
        assert err.key, f"error without a key: {err}"
        # the message shows the key as one printable line (control characters escaped)
        assert str(err).startswith(one_line(err.key))
        assert "\n" not in str(err)
        return
    if req is not None:
        assert isinstance(req.spec, RecipeSpec)
        # a returned spec is valid: rebuilding it from its own data changes nothing
        assert RecipeSpec.from_mapping(req.spec.to_dict()) == req.spec


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5))
def test_from_mapping_never_raises_anything_else(mapping):
    try:
        RecipeSpec.from_mapping({"name": "x", "scaling": "block", **mapping})
    except FP8ConfigError as err:
        assert err.key
