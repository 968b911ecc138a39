"""``nemo-fp8 doctor`` on a NeMo RL config: what ``apply`` refuses of it, and its pre-flight
(the rollout kernels and scale grid, the KV cache of a colocated engine) for the verdict."""

from __future__ import annotations

from typing import Any

__all__ = ["nemo_rl_run", "with_preflight"]


def nemo_rl_run(config: str, ctx, hardware: str | None, stack: str | None):
    """``(findings, result)`` of ``apply`` on a NeMo RL config (for ``--hardware``, ``--stack``):
    its refusal as one error finding, else the result, whose pre-flight doctor shows."""
    from ..errors import FP8ConfigError
    from ..hosts import get_adapter, load_context, run
    from ..hosts.nemo_rl.values import InterpolationError
    from ..spec import Finding

    try:
        if hardware is not None or stack is not None:
            ctx = load_context(config, hardware=hardware, stack=stack, host="nemo-rl")
    except FP8ConfigError:  # the recipe cannot run there: the verdict says so
        pass
    try:
        return [], run(get_adapter("nemo-rl"), ctx)
    except InterpolationError:
        raise  # a mistake in the config, not a verdict: one line, exit 2
    except FP8ConfigError as err:
        if ctx.request is None and err.key == "--hardware":
            return [], None  # a config in NeMo RL's own keys: the recipe's verdict says it
        return [Finding("error", err.key or "nemo-rl", err.bare_message)], None


def with_preflight(checked: dict[str, Any], result) -> dict[str, str]:
    """``checked`` (a recipe's verdict) with NeMo RL's pre-flight records (rollout kernels, KV
    cache); the kernel variables a release without ``vllm_cfg.env_vars`` needs where NeMo RL
    starts (its workers inherit them), for doctor to check in this shell."""
    checked.update({k: v for k, v in result.checks.items() if k in ("rollout", "kv_cache")})
    needed = result.checks.get("rollout", {}).get("needed", {})
    return {var: want for var, want in needed.items() if var in result.env}
