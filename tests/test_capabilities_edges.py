"""Capability edges the suite did not pin: sequence parallelism with TP=1 (nothing to split,
so no extra alignment) and every SM 12.x minor version (the SM 12 family)."""

from __future__ import annotations

import pytest

from nemo_fp8_plugin.capabilities import CAPABILITIES, arch_of_capability, token_alignment


@pytest.mark.parametrize("scaling", sorted(CAPABILITIES))
def test_sequence_parallel_with_tp1_adds_no_alignment(scaling):
    base = CAPABILITIES[scaling].token_align
    assert token_alignment(scaling, tensor_parallel=1, sequence_parallel=True) == base
    assert token_alignment(scaling, tensor_parallel=1, sequence_parallel=False) == base
    assert token_alignment(scaling, tensor_parallel=4, sequence_parallel=True) == 4 * base
    assert token_alignment(scaling, tensor_parallel=4, sequence_parallel=False) == base


def test_token_alignment_literals():
    assert token_alignment("block", tensor_parallel=1, sequence_parallel=True) == 16
    assert token_alignment("mx", tensor_parallel=1, sequence_parallel=True) == 32
    assert token_alignment("nvfp4", tensor_parallel=1, sequence_parallel=True) == 128
    assert (
        token_alignment("mx", tensor_parallel=2, sequence_parallel=True, context_parallel=2) == 256
    )


@pytest.mark.parametrize("minor", range(10))
def test_every_sm12_minor_version_is_the_sm12_family(minor):
    arch = arch_of_capability(12, minor)
    assert arch is not None and arch.name == "blackwell_sm120"


@pytest.mark.parametrize(
    "cc,name",
    [
        ((8, 0), "ampere"),
        ((8, 9), "ada"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((10, 3), "blackwell"),
        ((11, 0), "blackwell"),
        ((13, 0), "blackwell_sm120"),
        ((7, 5), None),
        ((9, 5), None),
    ],
)
def test_arch_of_capability_literals(cc, name):
    arch = arch_of_capability(*cc)
    assert (arch.name if arch is not None else None) == name
