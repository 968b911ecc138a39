"""The GPU device check (scripts/gpu_check.sh, nemo_fp8_plugin/tools/gpu_check/) on the CPU.

No GPU here, so every part is driven as far as Python reaches: the whole check through the
script with only torch importable (no PyYAML, TE, vLLM: their parts say why they skip); the
quantizer part with planted mismatches; the GEMM part on torch's CPU ``scaled_mm``; the TE
parts on stand-ins that lay out scales as TE's own ``get_scale_shape`` (read from the TE
wheel) says, with TE's real recipe module; the vLLM part's command against the refit
script's real argument parser, and its reading of the JSON file the script's own
``result_payload`` writes; the script's engine arguments against vLLM 0.32's ``EngineArgs``
(in .venv-vllm).
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import IN_CI, REPO, load_te_recipe_module, upstream_file
from nemo_fp8_plugin import get_recipe, list_recipes
from nemo_fp8_plugin.registry import default_registry
from nemo_fp8_plugin.tools import gpu_check
from nemo_fp8_plugin.tools.gpu_check import gemm as gemm_part
from nemo_fp8_plugin.tools.gpu_check import presets
from nemo_fp8_plugin.tools.gpu_check import te as te_part
from nemo_fp8_plugin.tools.gpu_check import vllm as vllm_part
from nemo_fp8_plugin.tools.gpu_check.result import Deadline
from nemo_fp8_plugin.tools.rl_check_bounds import TOKEN_MULT_PROB_ERROR_BOUND

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a descriptor only: nothing below touches a GPU

# What a machine with only torch lacks; blocked at interpreter start by a sitecustomize.
NOT_ON_A_TORCH_ONLY_MACHINE = (
    "yaml",
    "omegaconf",
    "transformer_engine",
    "transformer_engine_torch",
    "vllm",
    "transformers",
    "safetensors",
    "megatron",
    "nemo",
    "nemo_run",
    "lightning",
    "matplotlib",
    "tqdm",
)


def refit_script():
    """scripts/gpu_vllm_refit.py as a module (it is a script, not part of the package)."""
    path = REPO / "scripts" / "gpu_vllm_refit.py"
    spec = importlib.util.spec_from_file_location("gpu_vllm_refit_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the whole check


@pytest.mark.slow
def test_whole_check_through_the_script_with_only_torch(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {NOT_ON_A_TORCH_ONLY_MACHINE!r}:\n"
        "    sys.modules[name] = None  # import raises, as where it is not installed\n"
    )
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, NEMO_FP8_FUSED="0", PYTHON=sys.executable, PYTHONPATH=str(site))
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    assert report["recipes"].startswith("built-in presets (PyYAML is not installed")
    assert parts["quantizers"]["status"] == "ok" and parts["quantizers"]["checked"] > 100
    assert "incomplete" not in parts["quantizers"]
    fake_quant = parts["quantizers"]["fake_quant"]
    assert fake_quant and all(row["bit_exact"] and row["differing"] == 0 for row in fake_quant)
    # every way the emulation fake-quantizes, eager and compiled, row- and column-wise
    assert {row["fn"] for row in fake_quant} == {
        "fake_quant_blockwise",
        "fake_quant_mxfp8",
        "fake_quant_per_tensor",
        "fake_quant_with_scale",
        "dequantize_nvfp4",
    }
    assert {row["fused"] for row in fake_quant} == {False, True}
    assert {row["case"] for row in fake_quant} == {"random", "edges"}
    # the child process sees the built-in presets only (other tests may register more here)
    reg = default_registry()
    builtins = {s.name for s in list_recipes() if reg.source(s.name).startswith("built-in")}
    assert {row["recipe"] for row in fake_quant} == builtins
    tiles = {tuple(row["tile"]) for row in fake_quant if row["tile"]}
    assert {(1, 128), (128, 1), (128, 128), (1, 32), (32, 1), (1, 16), (16, 16)} <= tiles
    assert {row["fmt"] for row in fake_quant} == {"e4m3", "e5m2", "e2m1"}
    assert parts["refit"]["status"] == "ok" and parts["refit"]["bit_exact"] is True
    assert parts["refit"]["refit_gb_s"] > 0 and parts["refit"]["copy_gb_s"] > 0
    bandwidth = parts["refit"]["quantizers"]
    assert bandwidth["kernel"] == "cpu" and bandwidth["clone_gb_s"] > 0  # the C++ kernels here
    for case in (
        "quantize_blockwise 1x128",
        "quantize_blockwise 128x128",
        "quantize_mxfp8 1x32",
        "quantize_per_tensor",
    ):
        assert bandwidth[case]["gb_s"] > 0 and bandwidth[case]["ratio_vs_clone"] > 0, case
    assert parts["gemm"] == {
        "status": "skipped",
        "seconds": parts["gemm"]["seconds"],
        "reason": "FP8 tensor-core GEMMs need a CUDA device",
    }
    for name in ("te_quantizers", "te_linear"):
        assert parts[name]["status"] == "skipped"
        assert parts[name]["reason"].startswith("Transformer Engine is not importable here")
    assert parts["vllm_refit"]["status"] == "skipped"
    assert parts["vllm_refit"]["reason"] == "vLLM is not installed here"
    assert all(p["seconds"] >= 0 for p in parts.values()) and report["budget_s"] == 570
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["env"]["NEMO_FP8_FUSED"] == "0"
    assert f"wrote {out}" in proc.stderr


def test_in_process_run_reads_the_registry_and_records_a_failing_part(monkeypatch):
    def broken(device, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(gpu_check, "check_refit", broken)
    report = gpu_check.run_checks("cpu", ("refit", "vllm_refit"), quick=True)
    assert report["recipes"] == "registry"
    refit = report["parts"]["refit"]
    assert refit["status"] == "failed" and refit["reason"] == "RuntimeError: planted"
    assert "planted" in refit["traceback"]
    assert report["parts"]["vllm_refit"]["status"] == "skipped"  # the rest still ran


def test_a_spent_budget_skips_the_parts_left(capsys):
    report = gpu_check.run_checks("cpu", ("gemm", "refit"), budget_s=1e-9)
    # the progress line says why, not just "skipped (0.0 s)"
    assert "gemm: skipped (0.0 s): the time budget (1e-09 s) was spent" in capsys.readouterr().err
    for part in report["parts"].values():
        assert part["status"] == "skipped"
        assert part["reason"] == "the time budget (1e-09 s) was spent before this part started"
    part = gpu_check._vllm_part(CUDA, Deadline(30))
    assert part["status"] == "skipped" and part["reason"].startswith("only 30 s of the time budget")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--parts", "quantizers,bogus"], "--parts: unknown bogus"),
        (["--parts", ","], "--parts names no part"),
        (["--budget", "0"], "--budget must be a positive number"),
        (["--device", "tpu:x"], "--device 'tpu:x'"),
    ],
)
def test_argument_mistakes_exit_2_with_one_line(tmp_path, capsys, args, needle):
    out = tmp_path / "x.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith("gpu_check: error: ")
    assert not out.exists()


def test_an_unwritable_out_is_refused_before_the_work(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a directory" in err and err.count("\n") == 1


@pytest.mark.slow
def test_cuda_requested_without_a_gpu_exits_2(tmp_path):
    if torch.cuda.is_available():
        return  # this file is about the CPU machine; on a GPU the script runs for real
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_fp8_plugin.tools.gpu_check",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # (torch's own import may warn first, about pynvml)
    assert proc.stderr.splitlines()[-1] == (
        "gpu_check: error: --device cuda: no CUDA device here; use --device cpu for a logic check"
    )
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- recipes without PyYAML


def test_presets_read_without_pyyaml_equal_pyyaml_and_the_registry():
    from nemo_fp8_plugin.registry import load_yaml_file
    from nemo_fp8_plugin.spec import RecipeSpec

    paths = presets.preset_paths()
    assert {"fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"} <= {
        p.stem for p in paths
    }
    for path in paths:
        mine = presets.read_preset(path)
        assert mine == load_yaml_file(path), path.name
        assert RecipeSpec.from_mapping(mine) == get_recipe(path.stem)


def test_preset_reader_refuses_what_it_does_not_read(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("name: x\nweight_block:\n  - 128\n  - 128\n")
    with pytest.raises(ValueError, match=r"x\.yaml:2: a block value; install PyYAML"):
        presets.read_preset(bad)
    bad.write_text("name: x\nweight_block: [1, 128\n")
    with pytest.raises(ValueError, match=r"x\.yaml:2: expected"):
        presets.read_preset(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("# c\na: 'q # not a comment'  # a comment\nb: {x: [], y: 1e-3, z: ~}\nc: -2\n")
    assert presets.read_preset(ok) == {
        "a": "q # not a comment",
        "b": {"x": [], "y": 1e-3, "z": None},
        "c": -2,
    }


# --------------------------------------------------------------------------- (a) quantizers


@pytest.mark.slow
def test_a_mismatch_is_reported_as_failed(monkeypatch):
    from nemo_fp8_plugin import numerics

    real = numerics.quantize_blockwise

    def off_by_one(x, *args, **kwargs):
        q = real(x, *args, **kwargs)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            bumped = (q.data.view(torch.uint8) ^ 1).view(q.data.dtype)
            return type(q)(data=bumped, scale_inv=q.scale_inv, fmt=q.fmt, block=q.block)
        return q

    # Only the reference path goes through the patched function; the device path must
    # then disagree, and the part must say so.
    monkeypatch.setattr(numerics, "quantize_blockwise", off_by_one)
    monkeypatch.setattr(numerics, "quantize_blockwise_fused", real)
    with numerics.fused_mode(False):
        result = gpu_check.check_quantizers(CPU, quick=True)
    assert result["status"] == "failed" and result["mismatches"]


@pytest.mark.slow
def test_a_fake_quant_mismatch_is_reported_as_failed(monkeypatch):
    from nemo_fp8_plugin.numerics import fused

    real = fused.fake_quant_mxfp8

    def one_ulp_off(x, *args, **kwargs):
        out = real(x, *args, **kwargs).clone()
        out.view(torch.int32)[0, 0] ^= 1
        return out

    # The CPU reference is quantize_mxfp8(...).dequantize(), so only the checked path
    # is off by one ulp in one element.
    monkeypatch.setattr(fused, "fake_quant_mxfp8", one_ulp_off)
    with fused.fused_mode(False):
        result = gpu_check.check_quantizers(CPU, quick=True)
    assert result["status"] == "failed"
    bad = [row for row in result["fake_quant"] if not row["bit_exact"]]
    assert bad and all(row["fn"] == "fake_quant_mxfp8" and row["differing"] == 1 for row in bad)
    assert {row["fused"] for row in bad} == {False, True}
    assert all(row["bit_exact"] for row in result["fake_quant"] if row["fn"] != "fake_quant_mxfp8")
    assert any(row["fn"] == "dequantize_nvfp4" for row in result["fake_quant"])
    assert bad[0] in result["mismatches"]


def test_quantizers_stop_at_their_deadline():
    specs = [get_recipe("fp8_blockwise"), get_recipe("fp8_delayed")]
    result = gpu_check.check_quantizers(CPU, quick=True, recipes=specs, deadline=Deadline(0))
    assert result["status"] == "ok" and result["fake_quant"] == []
    assert result["incomplete"] == (
        "the part's share of the time budget ran out: fp8_blockwise/input, fp8_blockwise/weight, "
        "fp8_blockwise/grad_output, fp8_delayed/input, fp8_delayed/weight, "
        "fp8_delayed/grad_output not checked"
    )


# --------------------------------------------------------------------------- (b) GEMMs


def test_gemm_part_runs_on_torchs_cpu_scaled_mm():
    result = gpu_check.check_gemm(CPU, sizes=(256,), require_cuda=False)
    assert result["status"] == "ok", result
    row = result["sizes"]["256"]
    assert row["bf16_tflops"] > 0
    for name in ("tensorwise", "rowwise"):  # what torch 2.13's CPU scaled_mm has
        assert 0 < row[name]["rel_error"] < gemm_part.MAX_REL_ERROR
        assert row[name]["tflops"] > 0 and row[name]["ratio_vs_bf16"] > 0
    for name in ("block_1x128_128x128", "block_1x128_1x128"):
        assert row[name].get("status") == "unsupported" or row[name]["rel_error"] < 0.1
    assert gpu_check.check_gemm(CPU)["reason"] == "FP8 tensor-core GEMMs need a CUDA device"


def test_gemm_part_fails_a_wrong_scale(monkeypatch):
    real = gemm_part._operand

    def doubled_tensor_scale(numerics, x, tile):
        data, scale_inv = real(numerics, x, tile)
        return data, (scale_inv * 2 if tile is None else scale_inv)

    monkeypatch.setattr(gemm_part, "_operand", doubled_tensor_scale)
    result = gpu_check.check_gemm(CPU, sizes=(256,), require_cuda=False)
    row = result["sizes"]["256"]
    assert result["status"] == "failed" and row["tensorwise"]["status"] == "failed"
    assert row["tensorwise"]["rel_error"] > 1 and "wrong layout" in row["tensorwise"]["reason"]
    assert "tflops" in row["rowwise"]


# --------------------------------------------------------------------------- (d, e) TE


def _te_source_function(member: str, cls: str | None, name: str, dest: Path, **namespace):
    """One function of Transformer Engine's wheel (pure Python), compiled on its own."""
    path = upstream_file("transformer_engine-2.20.2-*.whl", member, dest)
    body = ast.parse(path.read_text()).body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = dict(namespace)
    # compiled as TE's file is, with postponed annotations (TE's typing names stay unneeded)
    code = compile(
        ast.Module([fn], []), str(path), "exec", flags=__future__.annotations.compiler_flag
    )
    exec(code, ns)
    return ns[name]


@pytest.fixture(scope="module")
def te_standins(tmp_path_factory):
    """Stand-ins for TE's modules where TE cannot load: a block quantizer that returns the
    reference's data with its scales in TE's padded GEMM layout, shaped by TE's own
    ``get_scale_shape``; ``te.Linear`` as a BF16 ``nn.Linear`` and an ``autocast`` that
    records the TE recipe objects it is given; TE's real recipe module."""
    from nemo_fp8_plugin import numerics

    dest = tmp_path_factory.mktemp("te")
    round_up = _te_source_function(
        "transformer_engine/pytorch/utils.py", None, "round_up_to_nearest_multiple", dest
    )
    scale_shape = _te_source_function(
        "transformer_engine/pytorch/tensor/float8_blockwise_tensor.py",
        "Float8BlockQuantizer",
        "get_scale_shape",
        dest,
        math=math,
        round_up_to_nearest_multiple=round_up,
    )

    class BlockQuantizer:
        block_len = 128  # Float8BlockQuantizer.__init__

        def __init__(
            self, fp8_dtype, *, rowwise, columnwise, force_pow_2_scales, block_scaling_dim
        ):
            assert fp8_dtype == "kFloat8E4M3" and rowwise and not columnwise
            self.pow2, self.block_scaling_dim = force_pow_2_scales, block_scaling_dim

        def __call__(self, x):
            tile = (1, 128) if self.block_scaling_dim == 1 else (128, 128)
            q = numerics.quantize_blockwise(x, block=tile, pow2_scales=self.pow2)
            padded = torch.full(scale_shape(self, x.shape, columnwise=False), float("nan"))
            if self.block_scaling_dim == 1:
                padded[:, : x.shape[0]] = q.scale_inv.t()
            else:
                padded[:, : q.scale_inv.shape[1]] = q.scale_inv
            return types.SimpleNamespace(_rowwise_data=q.data, _rowwise_scale_inv=padded)

    seen = []

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        assert enabled
        seen.append(recipe)
        yield

    def linear(n_in, n_out, bias, params_dtype, device):
        return torch.nn.Linear(n_in, n_out, bias=bias, dtype=params_dtype, device=device)

    te = types.SimpleNamespace(Linear=linear, autocast=autocast)
    tex = types.SimpleNamespace(DType=types.SimpleNamespace(kFloat8E4M3="kFloat8E4M3"))
    recipe = load_te_recipe_module(dest, name="te_recipe_for_gpu_check")
    return te_part.TEModules(te, tex, BlockQuantizer, recipe), seen


def test_te_parts_skip_with_the_reason_when_te_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    for check in (gpu_check.check_te_quantizers, gpu_check.check_te_linear):
        result = check(CUDA)
        assert result["status"] == "skipped"
        assert result["reason"].startswith(
            "Transformer Engine is not importable here (ModuleNotFoundError"
        )


def test_te_quantizer_part_reads_tes_padded_scale_layout(te_standins):
    mods, _ = te_standins
    result = gpu_check.check_te_quantizers(CPU, te_modules=mods, require_cuda=False)
    assert result["status"] == "ok"
    assert len(result["results"]) == 8 and all(r["bit_exact"] for r in result["results"])
    assert {(tuple(r["tile"]), r["pow2"]) for r in result["results"]} == {
        ((1, 128), False),
        ((1, 128), True),
        ((128, 128), False),
        ((128, 128), True),
    }
    assert gpu_check.check_te_quantizers(CPU, te_modules=mods)["reason"] == (
        "Transformer Engine's quantizers run on CUDA only"
    )


def test_te_quantizer_part_fails_one_scale_off(te_standins):
    mods, _ = te_standins

    class OffByOne(mods.block_quantizer):
        def __call__(self, x):
            got = super().__call__(x)
            got._rowwise_scale_inv.view(torch.int32)[0, 0] ^= 1
            return got

    result = gpu_check.check_te_quantizers(
        CPU, te_modules=mods._replace(block_quantizer=OffByOne), require_cuda=False
    )
    assert result["status"] == "failed" and not any(r["bit_exact"] for r in result["results"])


def test_unpad_te_scales_inverts_tes_layout():
    ref = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)  # M=6 rows, 3 tiles of 1x128
    padded = torch.full((3, 8), float("nan"))  # [ceil(K/128), roundup(M, 4)]
    padded[:, :6] = ref.t()
    assert torch.equal(te_part.unpad_te_scales(padded, 1, 6, 3), ref)
    ref2 = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)  # 128x128 tiles
    padded2 = torch.full((2, 4), float("nan"))  # [ceil(M/128), roundup(ceil(K/128), 4)]
    padded2[:, :3] = ref2
    assert torch.equal(te_part.unpad_te_scales(padded2, 2, 256, 3), ref2)


def test_te_linear_part_on_hopper_builds_every_tes_recipe(te_standins):
    mods, seen = te_standins
    seen.clear()
    result = gpu_check.check_te_linear(
        CPU, n=128, te_modules=mods, require_cuda=False, capability=(9, 0)
    )
    assert result["status"] == "ok" and result["arch"] == "hopper"
    rows = result["results"]
    assert rows["bf16_ms"] > 0
    for name in ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise"):
        assert rows[name]["ms"] > 0 and rows[name]["speedup_vs_bf16"] > 0
    assert rows["mxfp8"]["status"] == "skipped" and "Blackwell" in rows["mxfp8"]["reason"]
    # warm-up and timed steps each ran under the recipe TE's own classes build
    assert {type(r).__name__ for r in seen} == {
        "DelayedScaling",
        "Float8CurrentScaling",
        "Float8BlockScaling",
    }


def test_te_linear_part_follows_the_capability_table(te_standins):
    mods, _ = te_standins
    sm120 = gpu_check.check_te_linear(
        CPU, n=128, te_modules=mods, require_cuda=False, capability=(12, 0)
    )
    assert sm120["arch"] == "blackwell_sm120"
    assert sm120["results"]["mxfp8"]["status"] == "skipped"  # TE: no MXFP8 on SM 12.0+
    assert "ms" in sm120["results"]["fp8_current"]
    ampere = gpu_check.check_te_linear(
        CPU, n=128, te_modules=mods, require_cuda=False, capability=(8, 0)
    )
    assert ampere == {"status": "skipped", "reason": "SM 8.0 has no FP8 tensor cores"}


def test_te_linear_part_fails_a_recipe_te_refuses(te_standins):
    mods, _ = te_standins

    @contextlib.contextmanager
    def refusing(enabled, recipe):
        if type(recipe).__name__ == "Float8CurrentScaling":
            raise RuntimeError("planted refusal")
        yield

    te = types.SimpleNamespace(Linear=mods.te.Linear, autocast=refusing)
    result = gpu_check.check_te_linear(
        CPU, n=128, te_modules=mods._replace(te=te), require_cuda=False, capability=(9, 0)
    )
    assert result["status"] == "failed"
    assert result["reason"] == "TE linear failed under fp8_current"
    assert result["results"]["fp8_current"]["reason"] == "RuntimeError: planted refusal"
    assert "ms" in result["results"]["fp8_blockwise"]


# --------------------------------------------------------------------------- (f) vLLM


def test_vllm_part_skips_with_the_reason_when_vllm_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert gpu_check.check_vllm_refit(CUDA) == {
        "status": "skipped",
        "reason": "vLLM is not installed here",
    }
    # a folder named vllm on sys.path (a namespace package) is not vLLM
    namespace = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    monkeypatch.setattr(vllm_part.importlib.util, "find_spec", lambda name: namespace)
    assert vllm_part.vllm_missing() == "vLLM is not installed here"


def test_vllm_command_is_what_the_refit_script_parses(tmp_path):
    script = refit_script()
    cmd = vllm_part.refit_command(vllm_part.refit_script(), tmp_path / "r.json")
    assert cmd[0] == sys.executable and Path(cmd[1]) == REPO / "scripts" / "gpu_vllm_refit.py"
    args = script.parse_args(cmd[2:])
    assert args.tiny and args.model is None and args.device == "cuda"
    assert args.kv_cache == "fp8" and args.enforce_eager and args.json == str(tmp_path / "r.json")
    assert (args.steps, args.prompts, args.max_tokens) == (2, 4, 16)
    assert args.recipe == "fp8_blockwise"


def _records(script, mult_prob_error: float, changed: float):
    return [
        script.StepRecord(
            step,
            0.01,
            0.02,
            0.03,
            100,
            200,
            0.5,
            64,
            vs_fp8_trainer={"token_mult_prob_error": mult_prob_error},
            refit_changed_logprobs=changed,
        )
        for step in (1, 2)
    ]


def _child(script, *, records=None, returncode=0, stderr="", write=True, raw=None, seen=None):
    """A stand-in for the refit script's process: parses its command with the script's own
    parser and writes what the script's ``result_payload`` writes."""

    def run(cmd, *, capture_output, text, timeout, env):
        args = script.parse_args(cmd[2:])
        if seen is not None:
            seen.update(cmd=cmd, timeout=timeout, env=env)
        if raw is not None:
            Path(args.json).write_text(raw)
        elif write:
            recs = records if records is not None else _records(script, 1.02, 0.1)
            _, failures = script.summarize(recs, args.max_mult_prob_error)
            spec = script.spec_for(args)
            payload = script.result_payload(args, spec, "cpu", 1.5, recs, failures)
            Path(args.json).write_text(json.dumps(payload))
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    return run


def test_vllm_part_runs_the_script_and_reads_its_json(monkeypatch):
    script = refit_script()
    monkeypatch.setattr(vllm_part, "vllm_missing", lambda: None)
    seen = {}
    result = gpu_check.check_vllm_refit(CUDA, timeout_s=123, run=_child(script, seen=seen))
    assert result["status"] == "ok", result
    data = result["result"]
    assert data["passed"] is True and data["failures"] == []
    assert [r["step"] for r in data["records"]] == [1, 2]
    assert (data["recipe"], data["kv_cache"], data["model"]) == ("fp8_blockwise", "fp8", "tiny")
    assert seen["timeout"] == 123
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert result["command"].endswith("--enforce-eager --json " + seen["cmd"][-1])
    assert not Path(seen["cmd"][-1]).exists()  # the temporary folder is gone


def test_vllm_part_reports_what_went_wrong(monkeypatch, tmp_path):
    script = refit_script()
    monkeypatch.setattr(vllm_part, "vllm_missing", lambda: None)
    bad = gpu_check.check_vllm_refit(
        CUDA, run=_child(script, records=_records(script, 1.3, 0.0), returncode=1)
    )
    assert bad["status"] == "failed" and bad["result"]["passed"] is False
    bound = f"1.3 > {TOKEN_MULT_PROB_ERROR_BOUND:g}"
    assert f"token_mult_prob_error vs the FP8-emulated trainer {bound}" in bad["reason"]
    assert "left the engine's logprobs unchanged" in bad["reason"]
    crashed = gpu_check.check_vllm_refit(
        CUDA,
        run=_child(
            script,
            returncode=1,
            write=False,
            stderr="Traceback ...\nTypeError: calculate_kv_scales",
        ),
    )
    assert crashed["reason"] == "gpu_vllm_refit.py exited 1 without writing vllm_refit.json"
    assert crashed["stderr"].endswith("TypeError: calculate_kv_scales")
    garbled = gpu_check.check_vllm_refit(CUDA, run=_child(script, raw="{not json"))
    assert garbled["status"] == "failed" and "is not readable JSON" in garbled["reason"]
    empty = gpu_check.check_vllm_refit(CUDA, run=_child(script, raw="{}"))
    assert empty["reason"] == "vllm_refit.json holds no records"

    def too_slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=b"engine starting")

    late = gpu_check.check_vllm_refit(CUDA, timeout_s=7, run=too_slow)
    assert late["reason"] == "gpu_vllm_refit.py did not finish within 7 s"
    assert late["stderr"] == "engine starting"
    missing = gpu_check.check_vllm_refit(CUDA, script=tmp_path / "nope.py", run=too_slow)
    assert missing["status"] == "skipped" and "runs from a source checkout" in missing["reason"]
    assert gpu_check.check_vllm_refit(CPU)["reason"] == "vLLM's FP8 kernels need a CUDA device"


def test_refit_script_engine_args_have_no_calculate_kv_scales():
    script = refit_script()
    args = script.parse_args(vllm_part.refit_command(Path("s.py"), Path("o.json"))[2:])
    kwargs = script.engine_args(args, script.spec_for(args), "/m", "cuda")
    assert kwargs["kv_cache_dtype"] == "fp8_e4m3" and "calculate_kv_scales" not in kwargs
    assert "skip_tokenizer_init" not in kwargs and kwargs["enforce_eager"]  # --tiny has one
    assert kwargs["quantization"] == "nemo_fp8" and kwargs["dtype"] == "bfloat16"


def test_refit_script_refuses_an_unwritable_json_before_the_work(tmp_path, capsys):
    assert refit_script().main(["--tiny", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # (vLLM is not installed here: 2 means it stopped before)
    assert err.startswith("gpu_vllm_refit: error: ") and "--json" in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.vllm
def test_refit_script_engine_args_construct_vllms_engine_args():
    """The host is the judge: vLLM 0.32's own EngineArgs takes what the script passes to
    vllm.LLM (an unknown field such as calculate_kv_scales is a TypeError there)."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        if IN_CI:
            pytest.fail(".venv-vllm must exist in CI (scripts/install.sh test)")
        pytest.skip(".venv-vllm is not installed here")
    code = (
        "import importlib.util, sys\n"
        f"path = {str(REPO / 'scripts' / 'gpu_vllm_refit.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('s', path)\n"
        "s = importlib.util.module_from_spec(spec)\n"
        "sys.modules['s'] = s\n"
        "spec.loader.exec_module(s)\n"
        "import vllm\n"
        "for kv in ('fp8', 'auto'):\n"
        "    a = s.parse_args(['--tiny', '--kv-cache', kv, '--enforce-eager'])\n"
        "    kw = s.engine_args(a, s.spec_for(a), '/tmp/tiny', 'cuda')\n"
        "    e = vllm.EngineArgs(**kw)\n"
        "    print(kv, e.kv_cache_dtype, e.quantization)\n"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["fp8 fp8_e4m3 nemo_fp8", "auto auto nemo_fp8"]
