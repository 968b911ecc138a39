"""Shared cases of the NeMo RL adapter tests (``tests/hosts/nemo_rl/test_nemo_rl_*.py``):
NVIDIA's configs, an OmegaConf resolver independent of the plugin's loader, the inputs the
tests write. NeMo RL itself cannot be installed (HOSTS.md), so outputs are resolved the way
its ``nemo_rl/utils/config.py::load_config_with_inheritance`` does it, with the real
OmegaConf: ``OmegaConf.load`` per file, parents (relative to the file's directory) merged
first with ``OmegaConf.merge``. Inputs are written to a temp dir whose ``defaults:`` points at
the real, read-only parent chain in tests/fixtures/nemo_rl."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from conftest import nemo_rl_configs, shared_nemo_rl
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

CONFIGS = nemo_rl_configs()

MAIN_STACK = "nemo-rl-main-2026-08-22"
"""The stack of the configs in tests/fixtures/nemo_rl (NVIDIA's, at main 7ea279a): the release
tests that need main's keys (``model_overrides``, ``is_mx``) apply for."""

VLLM = "policy.generation.vllm_cfg"

MEG = "policy.megatron_cfg"

# The FP8 keys of NVIDIA's twins (the keys that differ between each BF16/FP8 pair).
FP8_KEYS = (
    "loss_fn.use_importance_sampling_correction",
    "loss_fn.truncated_importance_sampling_type",
    "loss_fn.truncated_importance_sampling_ratio",
    "policy.precision",
    f"{MEG}.fp8_cfg",
    f"{MEG}.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
    f"{MEG}.optimizer.use_precision_aware_optimizer",
    f"{MEG}.moe_router_dtype",
    f"{VLLM}.precision",
    f"{VLLM}.use_deep_gemm",
    f"{VLLM}.kv_cache_dtype",
    f"{VLLM}.num_first_layers_in_bf16",
    f"{VLLM}.num_last_layers_in_bf16",
    f"{VLLM}.quantization_ignored_layer_kws",
)


def nemo_rl_load(path: Path) -> DictConfig:
    """NeMo RL's loading semantics (see module docstring), with the real OmegaConf."""
    path = Path(path)
    cfg = OmegaConf.load(path)
    if "defaults" in cfg:
        parents = cfg.pop("defaults")
        parents = [parents] if isinstance(parents, str) else [str(p) for p in parents]
        base = OmegaConf.create({})
        for parent in parents:
            parent_path = Path(parent) if parent.startswith("/") else path.parent / parent
            base = OmegaConf.merge(base, nemo_rl_load(parent_path))
        cfg = OmegaConf.merge(base, cfg)
    return cfg


def resolved(path: Path) -> dict:
    return OmegaConf.to_container(nemo_rl_load(path), resolve=False)


def flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def is_fp8_key(key: str) -> bool:
    """Listed, under a listed key, or an ancestor of one (e.g. `env_vars` itself)."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FP8_KEYS)


MISSING = "<absent>"


def write_input(tmp_path: Path, bf16_file: Path, edit, *, relative_defaults: bool) -> Path:
    """The BF16 file's own keys, edited, in tmp_path, with `defaults:` at the real parent."""
    data = yaml.safe_load(bf16_file.read_text())
    parent = (bf16_file.parent / data["defaults"]).resolve()
    data["defaults"] = os.path.relpath(parent, tmp_path) if relative_defaults else str(parent)
    edit(data)
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str) -> int:
    return cli_main(list(args))


def check_pair(tmp_path: Path, bf16_name: str, twin_name: str, edit, relative_defaults=True):
    src = write_input(tmp_path, CONFIGS / bf16_name, edit, relative_defaults=relative_defaults)
    return check_against_twin(tmp_path, src, bf16_name, twin_name)


ALIGNMENT_DEVIATIONS = {
    "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml": {
        # Packing off, so the unpacked path pads sequences only to this value, and the twin's
        # ${policy.megatron_cfg.tensor_model_parallel_size} is 1: TE's assert_dim_for_fp8_exec
        # needs the tokens per GEMM to be a multiple of 16 (get_align_size_for_quantization),
        # so the plugin raises it (tests/hosts/test_alignment.py) where the twin would depend on luck.
        "policy.make_sequence_length_divisible_by": 16,
    },
}

"""Keys where the plugin's output deliberately differs from NVIDIA's twin, with the value it
writes and why."""


def check_against_twin(tmp_path: Path, src: Path, bf16_name: str, twin_name: str):
    out = tmp_path / "written" / "fp8.yaml"  # another directory: `defaults:` must be re-pointed
    out.parent.mkdir(exist_ok=True)  # an output's folder must exist
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    ours, twin, bf16 = (
        flatten(resolved(p)) for p in (out, CONFIGS / twin_name, CONFIGS / bf16_name)
    )
    deviations = ALIGNMENT_DEVIATIONS.get(twin_name, {})
    for key, value in deviations.items():
        assert ours[key] == value and twin.get(key) != value, key
    for key in sorted(set(ours) | set(twin)):
        if any(key == k or key.startswith(k + ".") for k in FP8_KEYS):
            assert ours.get(key, MISSING) == twin.get(key, MISSING), key
    for key in sorted(set(ours) | set(bf16)):
        if not is_fp8_key(key) and key not in deviations:
            assert ours.get(key, MISSING) == bf16.get(key, MISSING), key
    text = out.read_text()
    data = yaml.safe_load(text)
    assert "fp8" not in data and "precision" not in data  # our keys are consumed
    return out, data


EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "nemo_rl"


def example_input(tmp_path: Path, name: str, parent: Path) -> Path:
    """A shipped example with its `defaults:` pointed at the real parent it is meant to sit by."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    assert (parent.parent / data["defaults"]) == parent  # the example names the right parent
    data["defaults"] = str(parent)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def eight_b(tmp_path, **fp8_edits):
    def edit(d):
        if fp8_edits:
            d["fp8"] = {"recipe": "fp8_blockwise", **fp8_edits}
        else:
            d["policy"]["precision"] = "fp8_blockwise"

    return write_input(
        tmp_path, CONFIGS / "grpo_math_8B_megatron.yaml", edit, relative_defaults=True
    )


def _with_native(tmp_path, native: dict, **fp8_edits):
    src = eight_b(tmp_path, **fp8_edits)
    data = yaml.safe_load(src.read_text())
    from nemo_fp8_plugin.config import deep_merge

    src.write_text(yaml.safe_dump(deep_merge(data, native), sort_keys=False))
    return src


def apply_8b(tmp_path, **fp8):
    """``fp8`` applied to NVIDIA's 8B config for the release it comes from (main 7ea279a)."""
    result = apply_path(
        NEMO_RL, eight_b(tmp_path, **fp8), output=tmp_path / "out.yaml", stack=MAIN_STACK
    )
    (tmp_path / "out.yaml").write_text(yaml.safe_dump(result.data, sort_keys=False))
    return flatten(resolved(tmp_path / "out.yaml")), [str(w) for w in result.warnings]


BF16_8B = None


def bf16_8b():
    global BF16_8B
    if BF16_8B is None:
        BF16_8B = flatten(resolved(CONFIGS / "grpo_math_8B_megatron.yaml"))
    return BF16_8B


def changed(ours: dict) -> dict:
    """Keys whose resolved value differs from the BF16 8B config's."""
    base = bf16_8b()
    return {
        k: ours.get(k, MISSING)
        for k in set(ours) | set(base)
        if ours.get(k, MISSING) != base.get(k, MISSING)
    }


IS_ON = {"loss_fn.use_importance_sampling_correction": True}


def _one_b(tmp_path, edit):
    """A child of NeMo RL's grpo_math_1B.yaml (DTensor training, Megatron off), edited."""
    data = {"defaults": str(CONFIGS / "grpo_math_1B.yaml")}
    edit(data)
    path = tmp_path / "one_b.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _gen_only(src: Path) -> Path:
    data = yaml.safe_load(src.read_text())
    data.pop("precision")
    data["fp8"] = {"recipe": "fp8_blockwise", "training": "bf16"}
    out = src.with_name("gen_only.yaml")
    out.write_text(yaml.safe_dump(data))
    return out


def nemo_rl_model_override_functions():
    """NeMo RL's own ``_merge_model_overrides``, ``_merge_model_override_value`` and
    ``_validate_model_override_conflicts``, compiled from the real
    ``nemo_rl/models/megatron/setup.py``. That module cannot be imported here (it imports
    Megatron-Bridge, which needs Python >= 3.12 and Transformer Engine), so only these three
    functions are taken from it, with the standard-library names they use; ``MegatronConfig``
    is a stand-in whose annotations are read from the real ``nemo_rl/models/policy/__init__.py``
    (the one thing ``_validate_model_override_conflicts`` asks of it)."""
    import ast
    import copy as copy_module
    from collections.abc import Mapping as MappingABC
    from dataclasses import fields, is_dataclass, replace
    from typing import Any

    setup = shared_nemo_rl("src/nemo_rl/models/megatron/setup.py")
    tree = ast.parse(setup.read_text())
    wanted = {
        "_merge_model_overrides",
        "_merge_model_override_value",
        "_validate_model_override_conflicts",
    }
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted
    policy = ast.parse(shared_nemo_rl("src/nemo_rl/models/policy/__init__.py").read_text())
    cls = next(n for n in policy.body if isinstance(n, ast.ClassDef) and n.name == "MegatronConfig")
    annotations = {n.target.id: Any for n in cls.body if isinstance(n, ast.AnnAssign)}
    stand_in = type("MegatronConfig", (), {"__annotations__": annotations})
    namespace = {
        "Mapping": MappingABC,
        "fields": fields,
        "is_dataclass": is_dataclass,
        "replace": replace,
        "copy": copy_module,
        "Any": Any,
        "MegatronConfig": stand_in,
    }
    exec(compile(ast.Module(body=body, type_ignores=[]), str(setup), "exec"), namespace)
    return namespace


# --------------------------------------------------------------------------- NeMo RL releases

RELEASE_SOURCE = {"0.6.0": "releases/v0.6.0", "0.7.0": "releases/v0.7.0", "main-2026-08-22": "src"}
"""Release -> its source folder in the shared NeMo RL tree (main's under ``src/``)."""

RELEASE_CONFIGS = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/", "main-2026-08-22": ""}
"""Release -> where its ``examples/configs`` are in the shared tree (main's at the top)."""


def source_names(tree) -> set[str]:
    """Every configuration name a NeMo RL module (``ast`` tree) declares or reads: fields of
    its classes (TypedDict, pydantic, dataclass), ``cfg["name"]``, ``cfg.get("name")``
    (``pop``, ``setdefault``), ``"name" in cfg`` and attribute reads (``config.grpo.name``)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if isinstance(node.slice.value, str):
                out.add(node.slice.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            if isinstance(node.left.value, str):
                out.add(node.left.value)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


_RELEASE_NAMES: dict[str, set[str]] = {}


def release_source_names(release: str) -> set[str]:
    """The names NeMo RL ``release``'s source (every file of it in the shared tree) declares or
    reads (:func:`source_names`), parsed once per process."""
    import ast

    if release not in _RELEASE_NAMES:
        names: set[str] = set()
        folder = shared_nemo_rl(f"{RELEASE_SOURCE[release]}/nemo_rl")
        for path in sorted(folder.rglob("*.py")):
            names |= source_names(ast.parse(path.read_text()))
        _RELEASE_NAMES[release] = names
    return _RELEASE_NAMES[release]
