"""Every registered recipe x mode x GPU x NeMo RL release, applied to NVIDIA's own base configs
of that release: the output holds only keys that release reads (the stacks table's key facts,
and independently the release's own source), or the request is refused in one line, naming
the release whenever another release accepts the same request. Block FP8 end to end is
accepted on all three.

In process and fast: each base config's ``defaults:`` chain is read once per release, and
each case is that context with another ``fp8:`` block (as ``load_context`` builds it).
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from nemo_rl_cases import RELEASE_CONFIGS, release_source_names

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.config import find_fp8_request
from nemo_fp8_plugin.dotted import flatten
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import load_context, run
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.registry import list_recipes

pytestmark = pytest.mark.torch_free

RELEASES = [r.name for r in stacks.NEMO_RL_RELEASES]

BASES = {
    "8B-pp2": "grpo_math_8B_megatron.yaml",
    "1B-megatron": "grpo_math_1B_megatron.yaml",
    "1B-dtensor": "grpo_math_1B.yaml",
    "8B-async": "recipes/llm/performance/grpo-llama3.1-8b-instruct-2n8g-async-1off.yaml",
}
"""NVIDIA's base configs the whole matrix runs on, present at every release: dense with
pipeline parallelism, dense without, the DTensor policy, asynchronous rollouts."""

MOE = "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml"
"""An MoE with MLA (Moonlight): block FP8 end to end and MXFP8 on every release (its per-layer
rules take ~0.15 s a case, so it is not run through the whole matrix; its keys are the same
ones the dense bases write, plus ``moe_router_dtype``)."""

MODES = {
    "end-to-end": {},
    "generation-only": {"training": "bf16"},
    "fp8-kv-cache": {"kv_cache": "fp8"},
    "bf16-edge-layers": {"bf16_layers": {"first": 1, "last": 1}},
    "qat": {"qat": "w4a16"},
}

GPUS = ("h100", "b200")


def _context(tmp_path, release: str, base: str):
    """``load_context`` of a child of NVIDIA's ``base`` (of ``release``) asking for a recipe,
    for the release's stack: the one read of the chain each case reuses."""
    parent = shared_nemo_rl(f"{RELEASE_CONFIGS[release]}examples/configs/{base}")
    child = tmp_path / f"{release}.yaml"
    child.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": {"recipe": "fp8_blockwise"}}))
    return load_context(child, stack=f"nemo-rl-{release}", check_hardware=True)


def _case(ctx, block: dict):
    """``ctx`` asking for ``block`` instead, as ``load_context`` would build it."""
    raw, resolved = dict(ctx.raw), dict(ctx.resolved)
    raw["fp8"] = resolved["fp8"] = block
    request = find_fp8_request(resolved)
    return dataclasses.replace(
        ctx, raw=raw, resolved=resolved, request=request, stated=frozenset(block)
    )


def _outcome(ctx, block: dict):
    """("ok", written keys) or ("refused", the error)."""
    try:
        result = run(NEMO_RL, _case(ctx, block))
    except FP8ConfigError as err:
        return "refused", err
    return "ok", [k for k, _ in flatten(result.written or {}) if k != "defaults"]


def _unread(release: str, keys: list[str]) -> list[str]:
    """The keys of ``keys`` ``release`` does not read: by the stacks table, and by its own
    source (every part of the covering key named there)."""
    names = release_source_names(release)
    out = []
    for key in keys:
        row = stacks.nemo_rl_key_fact(key)
        if row is None or stacks.lookup("nemo-rl", row.name, release).present is not True:
            out.append(f"{key} (table)")
        elif not all(part in names for part in row.name.split(".")):
            out.append(f"{key} (source)")
    return out


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_case_writes_only_keys_the_release_reads_or_is_refused_naming_it(tmp_path, base):
    recipes = [r.name for r in list_recipes()]  # the registry's, never a hand-written list
    contexts = {r: _context(tmp_path, r, BASES[base]) for r in RELEASES}
    accepted = 0
    for recipe in recipes:
        for mode, extra in MODES.items():
            for gpu in GPUS:
                block = {"recipe": recipe, "hardware": gpu, **extra}
                outcomes = {}
                for release in RELEASES:
                    try:
                        outcomes[release] = _outcome(contexts[release], block)
                    except FP8ConfigError as err:  # the request itself (find_fp8_request)
                        outcomes[release] = ("refused", err)
                anywhere = any(kind == "ok" for kind, _ in outcomes.values())
                for release, (kind, what) in outcomes.items():
                    case = (base, recipe, mode, gpu, release)
                    if kind == "ok":
                        assert not _unread(release, what), (case, _unread(release, what))
                        accepted += 1
                        continue
                    message = str(what)
                    assert "\n" not in message and what.key, (case, message)
                    if anywhere:  # another release takes it: this one's refusal names itself
                        assert stacks.release_label(release) in message, (case, message)
    assert accepted, base


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("base", ["8B-pp2", "8B-async", "moe"])
def test_block_fp8_end_to_end_is_accepted_on_every_release(tmp_path, release, base):
    ctx = _context(tmp_path, release, BASES.get(base, MOE))
    kind, written = _outcome(ctx, {"recipe": "fp8_blockwise", "hardware": "h100"})
    assert kind == "ok", written
    assert "policy.megatron_cfg.fp8_cfg.enabled" in written
    assert "policy.generation.vllm_cfg.precision" in written
    assert not _unread(release, written)
    if base == "moe":
        assert "policy.megatron_cfg.moe_router_dtype" in written
        kind, what = _outcome(ctx, {"recipe": "mxfp8", "hardware": "b200"})
        if release == stacks.NEMO_RL_MAIN:
            assert kind == "ok" and not _unread(release, what), what
        else:
            assert kind == "refused" and stacks.release_label(release) in str(what), what
