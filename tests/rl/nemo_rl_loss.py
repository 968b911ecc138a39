"""NeMo RL's own ``ClippedPGLossFn`` (and GRPO's sequence masking), run from the shared source.

``nemo_rl/algorithms/loss/loss_functions.py`` of each release cannot be imported here: its
package imports ray, Megatron, transformers and modules the shared tree does not hold
(``loss/interfaces.py``, ``distributed/batched_data_dict.py``). So the classes the importance
weights come from (``ClippedPGLossConfig``, ``ClippedPGLossFn``) are taken from the release's
file by ``ast`` and run with the real torch, with ``masked_mean`` / ``calculate_kl`` from the
same release's ``algorithms/utils.py`` (likewise by ``ast``). What stands in for the absent
modules carries no arithmetic: ``LossFunction`` (a base class), the ``LossType`` /
``LossInputType`` / ``MetricNormalizer`` enums (compared by identity only) and
``BatchedDataDict`` (a ``dict``; the loss only indexes it). Nothing of the function's code is
changed.

The weights are a local of ``__call__`` (``actor_importance_weights``, after the truncation);
they are read off its frame as it returns, with ``sys.settrace``, so the value is the one
NeMo RL multiplies into the loss.
"""

from __future__ import annotations

import ast
import enum
import functools
import sys
import typing
from typing import Any

import torch

from conftest import shared_nemo_rl

RELEASES = {"v0.6.0": "releases/v0.6.0", "v0.7.0": "releases/v0.7.0", "main": "src"}
"""The NeMo RL trees of the shared data: two releases and the main snapshot (7ea279a)."""


def _defs(path, names: set[str]) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    nodes = [
        n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names
    ]
    assert {n.name for n in nodes} == names, (path, names)
    return nodes


class _Enum(enum.Enum):
    """Members by name, values irrelevant: the loss compares them by identity."""


LossType = _Enum("LossType", ["TOKEN_LEVEL", "SEQUENCE_LEVEL"])
LossInputType = _Enum(
    "LossInputType",
    ["LOGIT", "LOGPROB", "DRAFT", "DISTILLATION", "DISTILLATION_CROSS_TOKENIZER"],
)
MetricNormalizer = _Enum("MetricNormalizer", ["TOKENS", "SEQUENCES", "NONE"])


class LossFunction:
    """Stands in for ``nemo_rl.algorithms.loss.interfaces.LossFunction`` (a protocol)."""


class BatchedDataDict(dict):
    """Stands in for NeMo RL's ``BatchedDataDict`` (a dict subclass)."""


def _namespace(release: str) -> dict[str, Any]:
    root = shared_nemo_rl(RELEASES[release])
    ns: dict[str, Any] = {"torch": torch, "Tensor": torch.Tensor, "print": lambda *a, **k: None}
    ns.update({n: getattr(typing, n) for n in ("Any", "NotRequired", "Optional", "TypedDict")})
    ns.update(
        LossFunction=LossFunction,
        LossType=LossType,
        LossInputType=LossInputType,
        MetricNormalizer=MetricNormalizer,
        BatchedDataDict=BatchedDataDict,
    )
    if release != "v0.6.0":
        from pydantic import BaseModel

        ns["BaseModel"] = BaseModel
    utils = root / "nemo_rl/algorithms/utils.py"
    code = ast.Module(body=_defs(utils, {"masked_mean", "calculate_kl"}), type_ignores=[])
    exec(compile(code, str(utils), "exec"), ns)
    return ns


_CACHE: dict[str, dict[str, Any]] = {}


def nemo_rl_loss(release: str) -> dict[str, Any]:
    """``ClippedPGLossConfig`` and ``ClippedPGLossFn`` of a release (``v0.6.0``, ``v0.7.0``,
    ``main``), compiled from its ``loss_functions.py`` (cached per release)."""
    if release not in _CACHE:
        ns = _namespace(release)
        path = shared_nemo_rl(RELEASES[release]) / "nemo_rl/algorithms/loss/loss_functions.py"
        names = {"ClippedPGLossFn", "ClippedPGLossDataDict", "ClippedPGLossConfig"}
        code = ast.Module(body=_defs(path, names), type_ignores=[])
        exec(compile(code, str(path), "exec"), ns)
        if release != "v0.6.0":  # its annotations name this namespace's typing imports
            ns["ClippedPGLossConfig"].model_rebuild(_types_namespace=ns)
        _CACHE[release] = ns
    return _CACHE[release]


@functools.cache
def nemo_rl_grpo(release: str, name: str):
    """A module-level function of the release's ``algorithms/grpo.py`` (which imports ray,
    vLLM and Megatron at module level), compiled alone with torch; its ``print`` silenced."""
    path = shared_nemo_rl(RELEASES[release]) / "nemo_rl/algorithms/grpo.py"
    ns: dict[str, Any] = {
        "torch": torch,
        "print": lambda *a, **k: None,
        "BatchedDataDict": BatchedDataDict,
    }
    ns.update({n: getattr(typing, n) for n in ("Any", "Optional")})
    exec(compile(ast.Module(body=_defs(path, {name}), type_ignores=[]), str(path), "exec"), ns)
    return ns[name]


def _config(release: str, **loss_cfg: Any):
    cfg: dict[str, Any] = {
        "reference_policy_kl_penalty": 0.0,
        "reference_policy_kl_type": "k3",
        "kl_input_clamp_value": None,
        "kl_output_clamp_value": None,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": None,
        "truncated_importance_sampling_type": None,
        "truncated_importance_sampling_ratio_min": None,
        "token_level_loss": True,
        "sequence_level_importance_ratios": False,
    }
    cfg.update(loss_cfg)
    if release == "v0.6.0":  # a TypedDict there; pydantic models since v0.7.0
        return cfg
    return nemo_rl_loss(release)["ClippedPGLossConfig"](**cfg)


def nemo_rl_importance_weights(
    release: str,
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    **loss_cfg: Any,
) -> torch.Tensor:
    """The importance weights NeMo RL's ``ClippedPGLossFn.__call__`` multiplies into the loss
    (``actor_importance_weights``), for log-probs ``[B, T]`` and NeMo RL's masks as given
    (``token_mask [B, T]``, ``sample_mask [B]``). NeMo RL drops the first position of each
    sequence (``[:, 1:]``), so a zero column is prepended here."""
    fn_cls = nemo_rl_loss(release)["ClippedPGLossFn"]
    if loss_cfg.get("sequence_level_importance_ratios"):
        loss_cfg.setdefault("token_level_loss", False)
    loss = fn_cls(_config(release, **loss_cfg))

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)

    data = BatchedDataDict(
        token_mask=pad(token_mask),
        sample_mask=sample_mask,
        advantages=pad(torch.ones_like(prev)),
        prev_logprobs=pad(prev),
        generation_logprobs=pad(gen),
        reference_policy_logprobs=pad(prev),
    )
    seen: dict[str, torch.Tensor] = {}
    code = fn_cls.__call__.__code__

    def trace(frame, event, arg):
        if event == "call" and frame.f_code is code:

            def local(frame, event, arg):
                if event == "return":
                    seen["w"] = frame.f_locals["actor_importance_weights"]
                return local

            return local
        return None

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        loss(
            prev.clone(),
            data,
            global_valid_seqs=sample_mask.sum(),
            global_valid_toks=(token_mask * sample_mask.unsqueeze(-1)).sum(),
        )
    finally:
        sys.settrace(old)
    return seen["w"]
