"""Fuzzing the promise: whatever a user writes, the plugin answers, or refuses in one line.

Hypothesis generates YAML configs for every host (valid and invalid, nested, aliased, with
duplicate keys, mixed types, wrong-typed host sections, ``defaults:`` chains), checkpoints
(shapes, dtypes, shards, index files) and arguments of the RL library API, and checks each
case against the project's promise:

* a command exits 0, or 2 with exactly one line on stderr and no traceback (run in-process
  through :func:`nemo_fp8_plugin.cli.main`, captured with ``capsys``: no subprocess);
* no file is touched but the output, and a refused ``apply`` leaves no output at all;
* no case runs away: one that hangs fails through the suite's per-test timeout
  (pytest-timeout, ``[tool.pytest.ini_options]``), not a wall-clock assertion;
* the library functions return, or raise :class:`FP8ConfigError` / ``TypeError``.

Budget: about 90 s on the 2-core CI machine (at most 3 minutes; ``NEMO_FP8_FUZZ_SCALE``
multiplies every example count, for a longer sweep by hand). Under ``CI=true`` the
``ci`` Hypothesis profile of ``tests/conftest.py`` derandomizes every test, so a failure
reproduces on the next run; locally each run explores new examples. Output paths (special
files, symlinks, the input itself) are fuzzed with the output-safety tests, not here; output
file names (any bytes), standard output (any encoding, or closed) and the environment
variables the package and Python read are fuzzed in tests/test_fuzz_streams.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import HOSTS
from nemo_fp8_plugin.registry import default_registry

SCALE = float(os.environ.get("NEMO_FP8_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


FUZZ = dict(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)

RECIPES = default_registry().names()
WORDS = RECIPES + [
    "fp8",
    "FP8",
    "bf16",
    "bfloat16",
    "bf16-mixed",
    "16-mixed",
    "fp8-blockwise",
    "mxfp8_x",
    "hybrid",
    "e4m3",
    "${policy.precision}",
    "auto",
    "fp8_e4m3",
    "bf16_mixed",
    "fp16_mixed",
    "nemo_fp8",
    "cpu",
    "h100",
    "a100",
    "b200",
    "",
    "megatron.bridge.training.mixed_precision.MixedPrecisionConfig",
    "nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision",
    "evil.MegatronMixedPrecision",
    "subprocess.Popen",
    "os.system",
    "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.1-8b",
    "*.linear_qkv",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(WORDS),
)

HOST_KEYS = [
    "precision",
    "fp8",
    "mixed_precision",
    "policy",
    "trainer",
    "plugins",
    "model",
    "config",
    "transformer",
    "megatron_cfg",
    "generation",
    "vllm_cfg",
    "fp8_cfg",
    "loss_fn",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "num_moe_experts",
    "quantization",
    "kv_cache_dtype",
    "kv-cache-dtype",
    "max-model-len",
    "max_model_len",
    "hf_overrides",
    "quantization_config",
    "_target_",
    "recipe",
    "bf16_layers",
    "first",
    "last",
    "modules",
    "pow2_scales",
    "fp8_param",
    "kv_cache",
    "training",
    "defaults",
    "env_vars",
    "ddp",
    "device",
    "model_name",
    "enabled",
    "fp8_recipe",
    "tensor_parallel_size",
]
keys = st.one_of(st.sampled_from(HOST_KEYS), st.text(min_size=1, max_size=8))

values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=16,
)

SKELETONS = {
    "nemo2": {
        "precision": "fp8_blockwise",
        "trainer": {"max_steps": 200, "plugins": None},
        "model": {"config": {"num_layers": 16}},
    },
    "bridge": {
        "mixed_precision": "fp8_blockwise",
        "model": {"tensor_model_parallel_size": 2, "num_layers": 32},
    },
    "megatron": {
        "precision": "fp8_current",
        "model": {
            "num_layers": 8,
            "hidden_size": 1024,
            "ffn_hidden_size": 4096,
            "num_attention_heads": 16,
        },
    },
    "nemo-rl": {
        "policy": {
            "model_name": "meta-llama/Llama-3.1-8B-Instruct",
            "precision": "fp8_blockwise",
            "megatron_cfg": {"enabled": True, "fp8_cfg": {"enabled": False}},
            "generation": {"backend": "vllm", "vllm_cfg": {"precision": "${policy.precision}"}},
        },
        "loss_fn": {"token_level_loss": True},
    },
    "vllm": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max-model-len": 8192,
        "precision": "fp8_blockwise",
    },
    "te": {"precision": "fp8_blockwise"},
}
assert set(SKELETONS) == set(HOSTS), "a host without a fuzzed skeleton"


def _paths(node, prefix=()):
    """Every key path of a nested mapping (where a mutation may land)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


@st.composite
def host_configs(draw, host: str):
    """A config of ``host``'s shape with a few mutations: a value replaced (wrong types
    included), a key added anywhere, a request key set to anything, a subtree shared (which
    YAML writes as an anchor and aliases)."""
    import copy

    cfg = copy.deepcopy(SKELETONS[host])
    for _ in range(draw(st.integers(0, 4))):
        paths = list(_paths(cfg))
        kind = draw(st.sampled_from(["replace", "add", "request", "fp8block"]))
        if kind == "replace" and paths:
            path = draw(st.sampled_from(paths))
            node = cfg
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = draw(values)
        elif kind == "add":
            containers = [()] + [p for p in paths if isinstance(_get(cfg, p), dict)]
            where = _get(cfg, draw(st.sampled_from(containers)))
            where[draw(keys)] = draw(values)
        elif kind == "request":
            cfg[draw(st.sampled_from(["precision", "mixed_precision", "fp8"]))] = draw(
                st.one_of(st.sampled_from(WORDS), values)
            )
        elif kind == "fp8block":
            from nemo_fp8_plugin.spec import RecipeSpec

            fields = st.sampled_from(list(RecipeSpec.OVERRIDABLE) + ["recipe", "model"])
            block = draw(st.dictionaries(fields, values, max_size=4))
            if draw(st.booleans()):
                block["recipe"] = draw(st.sampled_from(RECIPES))
            cfg["fp8"] = block
    paths = list(_paths(cfg))
    if paths and draw(st.booleans()):  # once, last: the tree stays acyclic
        a, b = draw(st.sampled_from(paths)), draw(st.sampled_from(paths))
        if b[: len(a)] != a and a[: len(b)] != b:  # neither inside the other
            _set(cfg, b, _get(cfg, a))
    return cfg


def _get(node, path):
    for part in path:
        node = node[part]
    return node


def _set(node, path, value):
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _dump(cfg) -> str:
    return yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)


def _snapshot(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_cli(capsys, *argv) -> tuple[int, str, str, float]:
    """``nemo-fp8 ARGV`` in-process: (exit code, stdout, stderr, seconds). A traceback (an
    exception main lets escape) fails the test with the exception itself."""
    capsys.readouterr()
    start = time.monotonic()
    rc = main([str(a) for a in argv])
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    return rc, out, err, took


def assert_promise(rc: int, err: str, took: float, argv) -> None:
    """``took`` (seconds) is kept for a failure's report; speed is not asserted here."""
    assert rc in (0, 2), (argv, rc, err)
    assert "Traceback" not in err, err
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith(f"nemo-fp8 {argv[0]}: error: "), lines[0]


def check_config_text(
    capsys, text: str, host: str, *, files: dict[str, str] | None = None, json_out: bool = False
) -> tuple[int, str]:
    """explain, then apply --host HOST -o OUT, on ``text``; the promise for both. Returns
    apply's exit code and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = root / "config.yaml"
        cfg.write_text(text, encoding="utf-8")
        for name, body in (files or {}).items():
            (root / name).write_text(body, encoding="utf-8")
        before = _snapshot(root)
        argv = ["explain", cfg] + (["--json"] if json_out else []) + ["--host", host]
        rc, out, err, took = run_cli(capsys, *argv)
        assert_promise(rc, err, took, argv)
        if rc == 0 and json_out:
            json.loads(out)
        assert _snapshot(root) == before, "explain touched a file"
        out_path = root / "out" / "applied.yaml"
        out_path.parent.mkdir()
        argv = ["apply", cfg, "--host", host, "-o", out_path]
        rc, _out, err, took = run_cli(capsys, *argv)
        assert_promise(rc, err, took, argv)
        after = _snapshot(root)
        written = {k for k in after if k not in before or after[k] != before[k]}
        assert written <= {"out/applied.yaml"}, written
        if rc == 2:
            assert not out_path.exists(), "a refused apply wrote its output"
            assert not any((root / "out").iterdir()), "a refused apply left a file behind"
        else:
            assert out_path.exists() and out_path.stat().st_size > 0
            yaml.safe_load(out_path.read_text(encoding="utf-8"))
        return rc, err


# --------------------------------------------------------------------------- configs, per host


@pytest.mark.parametrize("host", HOSTS)
@settings(max_examples=examples(100), **FUZZ)
@given(data=st.data())
def test_every_host_answers_or_refuses_in_one_line(capsys, host, data):
    cfg = data.draw(host_configs(host))
    check_config_text(capsys, _dump(cfg), host, json_out=data.draw(st.booleans()))


@settings(max_examples=examples(60), **FUZZ)
@given(cfg=host_configs("megatron"), host=st.sampled_from(HOSTS), where=st.integers(0, 6))
def test_a_duplicate_key_at_any_depth_is_refused_with_both_lines(capsys, cfg, host, where):
    text = _dump(cfg)
    lines = text.splitlines()
    # A key written twice in one mapping, at the top level or nested (a flow mapping inside).
    if where % 2:
        lines.append(f"dup_{where}: {{a: 1, b: [1, {{c: 2, c: 3}}]}}")
        first = second = len(lines)
    else:
        top = [i for i, ln in enumerate(lines) if re.match(r"[A-Za-z_][\w-]*:( |$)", ln)]
        assume(top)
        index = top[where % len(top)]
        key = lines[index].split(":")[0]
        lines.append(f"{key}: 1")
        first, second = index + 1, len(lines)
    rc, err = check_config_text(capsys, "\n".join(lines) + "\n", host)
    assert rc == 2 and "duplicate key" in err, err
    assert f"line {second}" in err and f"first at line {first}" in err, err


@settings(max_examples=examples(40), **FUZZ)
@given(depth=st.integers(1, 90), flow=st.booleans(), host=st.sampled_from(HOSTS), leaf=scalars)
def test_deep_nesting_is_refused_or_read(capsys, depth, flow, host, leaf):
    from nemo_fp8_plugin.errors import LIMITS

    if flow:
        # the leaf as PyYAML writes it (quoted and escaped as needed), on one line
        body = (
            "[" * depth
            + yaml.safe_dump(leaf, default_flow_style=True, width=10**9)
            .splitlines()[0]
            .removesuffix(" ...")
            + "]" * depth
        )
        text = f"precision: fp8_blockwise\nextra: {body}\n"
    else:
        text = (
            "precision: fp8_blockwise\n"
            + "".join("  " * i + f"k{i}:\n" for i in range(depth))
            + "  " * depth
            + "leaf: 1\n"
        )
    rc, err = check_config_text(capsys, text, host)
    if depth + 1 > LIMITS.yaml_depth:
        assert rc == 2 and "levels deep" in err, err


@settings(max_examples=examples(40), **FUZZ)
@given(
    width=st.integers(2, 12),
    depth=st.integers(1, 9),
    host=st.sampled_from(HOSTS),
    where=st.sampled_from(["precision", "fp8", "model", "mixed_precision", "extra"]),
)
def test_aliases_expand_within_bounds(capsys, width, depth, host, where):
    """An anchor referenced ``width`` times per level, ``depth`` levels: up to 12^9 values
    once expanded (a "billion laughs"), in any position, including one whose wrong type makes
    the error message render the value."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, depth):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    lines.append(f"{where}: *a{depth - 1}")
    check_config_text(capsys, "\n".join(lines) + "\n", host)


@settings(max_examples=examples(40), **FUZZ)
@given(length=st.integers(0, 20), loop=st.booleans(), fan=st.integers(1, 3), missing=st.booleans())
def test_defaults_chains_are_bounded(capsys, length, loop, fan, missing):
    """NeMo RL ``defaults:`` chains: long, looping, fanning out (a parent named by several
    children is parsed once), or naming a file that is not there."""
    files = {}
    for i in range(length):
        parents = (
            [f"p{i + 1}.yaml"] * fan
            if i + 1 < length
            else (["p0.yaml"] if loop else (["gone.yaml"] if missing else []))
        )
        body = {"policy": {"megatron_cfg": {f"k{i}": i}}}
        if parents:
            body["defaults"] = parents if fan > 1 else parents[0]
        files[f"p{i}.yaml"] = _dump(body)
    top = {"defaults": "p0.yaml"} if length else {}
    top.update(SKELETONS["nemo-rl"])
    check_config_text(capsys, _dump(top), "nemo-rl", files=files)


@settings(max_examples=examples(20), **FUZZ)
@given(
    host=st.sampled_from(HOSTS),
    kind=st.sampled_from(["fifo", "dir", "missing", "binary", "empty", "list", "huge-line"]),
)
def test_a_config_that_is_no_yaml_file_is_refused_in_one_line(capsys, host, kind):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        if kind == "fifo":
            os.mkfifo(path)  # reading it would block forever
        elif kind == "dir":
            path.mkdir()
        elif kind == "binary":
            path.write_bytes(b"\xff\xfe\x00precision: \x80\n")
        elif kind == "empty":
            path.write_text("")
        elif kind == "list":
            path.write_text("- precision: fp8_blockwise\n")
        elif kind == "huge-line":
            path.write_text("precision: " + "x" * 100_000 + "\n")
        for argv in (["explain", path], ["apply", path, "--host", host], ["doctor", path]):
            rc, _out, err, took = run_cli(capsys, *argv)
            assert_promise(rc, err, took, argv)
            if kind in ("fifo", "dir", "missing", "binary", "list", "huge-line"):
                assert rc == 2, (argv, err)


# --------------------------------------------------------------------------- checkpoints

TENSOR_NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.1.mlp.experts.w13_weight",
    "weird name",
    "x",
]
DTYPES = ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float64", "bool"]


@st.composite
def checkpoints(draw):
    """A checkpoint directory's files, as instructions: shards of tensors (shapes, dtypes,
    names repeated across shards), an index (valid, naming a missing file, ``../x``, an
    absolute path, a subdirectory, not JSON, a list), a config.json, a FIFO."""
    shards = []
    for _ in range(draw(st.integers(0, 3))):
        tensors = draw(
            st.dictionaries(
                st.sampled_from(TENSOR_NAMES),
                st.tuples(
                    st.lists(st.integers(0, 160), min_size=0, max_size=3), st.sampled_from(DTYPES)
                ),
                max_size=3,
            )
        )
        shards.append(tensors)
    index = draw(
        st.sampled_from(
            [
                "none",
                "valid",
                "missing",
                "dotdot",
                "absolute",
                "subdir",
                "not-json",
                "list",
                "fifo-shard",
            ]
        )
    )
    config = draw(st.sampled_from(["llama", "none", "garbage", "huge-layers"]))
    return shards, index, config


def _write_checkpoint(root: Path, shards, index, config) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for tname, (shape, dtype) in tensors.items():
            t = torch.randn(*shape, generator=gen) if shape else torch.randn((), generator=gen)
            data[tname] = t.to(getattr(torch, dtype))
            weight_map[tname] = name
        save_file(data, str(root / name))
    if index != "none":
        bad = {
            "missing": "nope.safetensors",
            "dotdot": "../outside.safetensors",
            "absolute": "/etc/passwd",
            "subdir": "sub/x.safetensors",
        }.get(index)
        if bad is not None:
            weight_map["model.extra.weight"] = bad
        if index == "fifo-shard":
            os.mkfifo(root / "fifo.safetensors")
            weight_map["model.fifo.weight"] = "fifo.safetensors"
        text = (
            "{not json"
            if index == "not-json"
            else json.dumps([1, 2])
            if index == "list"
            else json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        (root / "model.safetensors.index.json").write_text(text)
    if config != "none":
        body = {
            "llama": {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 4,
                "vocab_size": 256,
            },
            "huge-layers": {
                "model_type": "llama",
                "num_hidden_layers": 10**9,
                "hidden_size": 128,
                "intermediate_size": 256,
            },
        }.get(config)
        (root / "config.json").write_text("[[[" if body is None else json.dumps(body))


@settings(max_examples=examples(80), **FUZZ)
@given(ckpt=checkpoints(), recipe=st.sampled_from(["fp8_blockwise", "mxfp8", "fp8_current"]))
def test_checkpoints_are_analyzed_exported_or_refused(capsys, ckpt, recipe):
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "ckpt"
        src.mkdir()
        _write_checkpoint(src, *ckpt)
        before = _snapshot(src)
        argv = ["analyze", src, "--json", "--no-progress", "--recipes", recipe]
        rc, out, err, took = run_cli(capsys, *argv)
        assert_promise(rc, err, took, argv)
        if rc == 0:
            json.loads(out)
        out_dir = root / "exported"
        try:
            export_fp8_checkpoint(src, out_dir, recipe, max_shard_bytes=4096)
        except FP8ConfigError as err:
            assert err.key, err
            assert not out_dir.exists(), "a refused export left its directory"
        else:
            assert (out_dir / "config.json").is_file()
        assert _snapshot(src) == before, "the source checkpoint was touched"
        leftovers = {p.name for p in root.iterdir()} - {"ckpt", "exported"}
        assert not leftovers, leftovers


# --------------------------------------------------------------------------- the RL library API

anything = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.sampled_from(
        [
            "false",
            "true",
            "0",
            "1",
            "nemo_fp8",
            "compressed_tensors",
            "fp8_blockwise",
            "mxfp8",
            "fp8_current",
        ]
    ),
    st.just(lambda *a: "false"),
    st.just(lambda *a: True),
    st.just(lambda *a: 1),
    st.just(object()),
)


@settings(max_examples=examples(200), **FUZZ)
@given(
    kwargs=st.dictionaries(
        st.sampled_from(
            [
                "keep_bf16",
                "num_layers",
                "tp_rank",
                "tp_size",
                "shard_dim",
                "is_linear_weight",
                "mx_scale_layout",
                "fused",
            ]
        ),
        anything,
        max_size=3,
    ),
    spec=st.one_of(st.sampled_from(["fp8_blockwise", "mxfp8", "fp8_subchannel"]), anything),
    items=st.sampled_from(["mapping", "pairs", "bad-pair", "not-tensor", "string", "number"]),
)
def test_quantize_for_refit_arguments(kwargs, spec, items):
    import torch

    from nemo_fp8_plugin.rl import quantize_for_refit

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    source = {
        "mapping": {"model.layers.0.mlp.down_proj.weight": w},
        "pairs": [("model.layers.0.self_attn.q_proj.weight", w)],
        "bad-pair": [("a.weight", w, 3)],
        "not-tensor": {"a.weight": [[1.0]]},
        "string": "model.weight",
        "number": 3,
    }[items]
    try:
        out = list(quantize_for_refit(source, spec, **kwargs))
    except (FP8ConfigError, TypeError) as err:
        assert str(err), "an error without a message"
        return
    assume(out)
    for name, tensor in out:
        assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


@settings(max_examples=examples(100), **FUZZ)
@given(
    model=st.one_of(st.just("module"), anything),
    forward=st.one_of(st.none(), anything),
    kwargs=st.dictionaries(
        st.sampled_from(
            ["percentile", "margin", "include_q", "sample", "layer_offset", "calibrator"]
        ),
        anything,
        max_size=2,
    ),
)
def test_refresh_scales_arguments(model, forward, kwargs):
    import torch

    from nemo_fp8_plugin.rl import refresh_scales

    module = torch.nn.Linear(4, 4)
    if model == "module":
        model = module
    try:
        update = refresh_scales(model, forward, **kwargs)
    except (FP8ConfigError, TypeError) as err:
        assert str(err)
        return
    assert isinstance(update, dict)


@settings(max_examples=examples(80), **FUZZ)
@given(
    kwargs=st.dictionaries(
        st.sampled_from(["config", "max_shard_bytes", "overwrite", "copy_other_files"]),
        anything,
        max_size=3,
    ),
    spec=st.one_of(st.sampled_from(["fp8_blockwise", "mxfp8"]), anything),
    out_kind=st.sampled_from(["path", "str", "number", "none"]),
)
def test_export_fp8_checkpoint_arguments(kwargs, spec, out_kind):
    import torch

    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    state = {"model.layers.0.mlp.down_proj.weight": torch.ones(128, 128)}
    kwargs.setdefault("config", {"model_type": "llama", "num_hidden_layers": 1})
    with tempfile.TemporaryDirectory() as tmp:
        target = {
            "path": Path(tmp) / "out",
            "str": str(Path(tmp) / "out"),
            "number": 7,
            "none": None,
        }[out_kind]
        with contextlib.suppress(FP8ConfigError, TypeError):
            result = export_fp8_checkpoint(state, target, spec, **kwargs)
            assert (Path(result.path) / "config.json").is_file()
        assert {p.name for p in Path(tmp).iterdir()} <= {"out"}
