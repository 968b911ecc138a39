"""`nemo-fp8 bench` runs end to end and reports ratios (a smoke run: the figures themselves
are benchmarks, recorded in docs/performance.md, never asserted in tests), and the harness
every tool times and records with."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from presets import preset_names


@pytest.mark.slow
def test_bench_quick_reports_every_ratio(tmp_path):
    out = tmp_path / "bench.json"
    # eager kernels: this checks the plumbing, not speed, and skips minutes of compiling
    env = dict(os.environ, NEMO_FP8_FUSED="0")
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("nemo-fp8")),
            "bench",
            "--quick",
            "--skip-bf16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    quant = result["quantize"]["rows"]
    assert quant["clone"]["x_clone"] == 1.0
    public = {
        "quantize_blockwise 1x128",
        "quantize_blockwise 128x128",
        "quantize_mxfp8 1x32",
        "quantize_per_tensor",
    }
    assert public | {"reference 1x128", "fused 128x128", "fused mxfp8 1x32"} <= set(quant)
    for name in public:
        assert quant[name]["x_clone"] > 0 and quant[name]["first_call_s"] >= 0
    assert result["quantize"]["kernels"]["quantize_blockwise"] == "cpu"
    assert result["quantize"]["first_call"]["cpu kernel build, empty cache (s)"] > 0
    linear = result["linear"]["rows"]
    for recipe in RECIPES:
        assert linear[recipe]["x_fp32"] > 0 and linear[recipe]["x_bf16_linear"] > 0
    assert set(result["linear"]["load_average"]) == {"start", "end"}
    assert "ratios count only at load < 1.5" in proc.stdout
    assert result["refit"]["rows"]["copy (clone)"]["x_copy"] == 1.0
    assert result["environment"]["torch"] and result["environment"]["env"]["NEMO_FP8_FUSED"] == "0"
    assert result["refit"]["rows"]["refit fused"]["GB/s"] > 0
    assert result["refit"]["rows"]["refit"]["x_copy"] > 0
    assert result["refit"]["kernel"] == "cpu"
    assert result["export"]["ratio"] > 0
    for heading in ("Quantizers", "first-call cost", "Linear fwd+bwd", "Refit quantizer"):
        assert heading in proc.stdout
    # the first section's progress: plain lines on stderr (a pipe here), no \r redrawing
    assert "bench: quantizers, first call, quantize_blockwise 1x128:" in proc.stderr
    assert "bench: linear, first run, nvfp4:" in proc.stderr
    assert "\r" not in proc.stderr


RECIPES = tuple(preset_names())


def test_linear_bench_sets_every_recipe_against_the_bf16_linear():
    """The emulated linear's fwd+bwd per recipe (six) against the same run's BF16-emulated
    linear, with the load average recorded and the verdict printed (a toy size: this
    checks that the benchmark runs and what it reports, not its ratios)."""
    from nemo_fp8_plugin.tools import bench

    result = bench.bench_linear(128, 64, 1, 0)
    rows = result["rows"]
    assert rows["bf16 linear"]["best_s"] > 0
    for recipe in RECIPES:
        assert rows[recipe]["x_bf16_linear"] == pytest.approx(
            rows[recipe]["best_s"] / rows["bf16 linear"]["best_s"]
        )
    assert result["quiet_load"] == 1.5
    text = bench.render_numerics({"quantize": bench.bench_quantize(64, 1), "linear": result})
    assert "x bf16 linear" in text and "ratios count only at load < 1.5" in text
    assert bench.load_verdict([0.5, 4.0]).endswith("these ratios do not count")
    assert bench.load_verdict([0.5, 1.2]).endswith("these ratios count")
    assert "unknown" in bench.load_verdict([None])


def test_quantize_bench_rows_and_ratios():
    """The quantizer benchmark in process at a toy size (eager compiled-variant fallback):
    every public function's row, ratios against the same run's clone, first calls apart."""
    from nemo_fp8_plugin.numerics import fused_mode
    from nemo_fp8_plugin.tools.bench import bench_quantize, render_quantize

    with fused_mode(False):
        result = bench_quantize(256, 2)
    rows = result["rows"]
    assert rows["clone"]["x_clone"] == 1.0
    for name in ("quantize_blockwise 1x128", "quantize_mxfp8 1x32", "quantize_per_tensor"):
        row = rows[name]
        assert row["GB/s"] > 0 and "first_call_s" in row
        assert row["x_clone"] == pytest.approx(row["GB/s"] / rows["clone"]["GB/s"])
    assert "first_call_s" not in rows["reference 1x128"]
    text = render_quantize(result)
    assert "quantize_per_tensor" in text and "x clone" in text


@pytest.mark.slow  # ~14 s: six recipes' first runs
def test_the_first_section_reports_each_case_as_it_goes(capsys):
    """The quantizer and linear benchmarks say what they finished, case by case (the full
    sizes run for minutes before their table), through the CLI's stderr lines."""
    from nemo_fp8_plugin.numerics import fused_mode
    from nemo_fp8_plugin.tools import bench
    from nemo_fp8_plugin.tools.harness import stderr_progress

    lines: list[str] = []
    with fused_mode(False):
        result = bench.bench_quantize(128, 2, progress=lines.append)
    cases = set(result["rows"]) - {"clone"}
    firsts = [line for line in lines if line.startswith("quantizers, first call, ")]
    assert len(firsts) == 7  # public and compiled variants; the references have no first call
    for case in cases:  # every case, in every round, as it is timed
        timed_lines = [
            line
            for line in lines
            if ", round " in line and line.endswith(" s") and f", {case}:" in line
        ]
        assert len(timed_lines) == 2, (case, lines)
    assert "quantizers, round 2/2, clone:" in "\n".join(lines)
    lines.clear()
    bench.bench_linear(128, 64, 1, 0, progress=lines.append)
    assert [line.split(":")[0] for line in lines[:6]] == [
        f"linear, first run, {recipe}" for recipe in RECIPES
    ]
    assert any(line.startswith("linear, round 1/1, bf16 linear:") for line in lines)
    report = stderr_progress("bench")
    report("quantizers, first call, x: 0.100 s")
    report("linear, round 1/1, fp32: 0.010 s")
    err = capsys.readouterr().err
    assert (
        err
        == "bench: quantizers, first call, x: 0.100 s\nbench: linear, round 1/1, fp32: 0.010 s\n"
    )


# --------------------------------------------------------------------------- the tools' harness
# (nemo_fp8_plugin/tools/harness.py: what bench, gpu_check, demo and rl-check time and record
# with; its CUDA branches are driven here through stand-ins for torch.cuda's calls)


class _FakeCuda:
    """Records torch.cuda.synchronize calls and hands out events 2.5 ms apart."""

    def __init__(self):
        self.syncs = []
        self.clock = 0.0

    def synchronize(self, device=None):
        self.syncs.append(device)

    def event(self, enable_timing=False):
        fake = self

        class Event:
            def record(self):
                fake.clock += 2.5
                self.at = fake.clock

            def synchronize(self):
                fake.syncs.append("event")

            def elapsed_time(self, end):
                return end.at - self.at

        assert enable_timing
        return Event()


def test_timing_waits_for_the_device(monkeypatch):
    import torch

    from nemo_fp8_plugin.tools import harness

    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    calls = []
    samples = harness.timed(lambda: calls.append(1), "cuda:0", reps=3, warmup=2)
    assert len(calls) == 5 and samples == [0.0025] * 3  # CUDA events, in seconds
    assert fake.syncs == ["cuda:0", "event", "event", "event"]  # after the warm-up; each end
    fake.syncs.clear()
    with harness.Stopwatch(torch.device("cuda")) as sw:
        pass
    assert fake.syncs == [torch.device("cuda")] * 2 and sw.seconds >= 0
    fake.syncs.clear()
    cpu = harness.timed(lambda: calls.append(1), torch.device("cpu"), reps=2)
    with harness.Stopwatch():
        harness.sync("cpu")
    assert fake.syncs == [] and len(cpu) == 2 and all(t >= 0 for t in cpu)
    times = harness.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=2
    )
    assert calls[-4:] == ["a", "b", "a", "b"] and {k: len(v) for k, v in times.items()} == {
        "a": 2,
        "b": 2,
    }


def test_environment_record(monkeypatch):
    import torch

    from nemo_fp8_plugin import __version__
    from nemo_fp8_plugin.tools.harness import environment

    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = environment()
    assert env["plugin"] == __version__ and env["torch"] == torch.__version__
    assert env["threads"] == torch.get_num_threads() and env["device"] == "cpu"
    assert env["cpu"] and env["python"].count(".") == 2 and env["isa"]
    assert env["env"]["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    assert env["env"]["VLLM_USE_DEEP_GEMM"] == "0" and env["env"]["OMP_NUM_THREADS"] == "2"
    assert "VLLM_API_KEY" not in env["env"] and "HF_TOKEN" not in env["env"]
    assert "gpu" not in env


def test_arm_records_and_ratios():
    from dataclasses import dataclass

    from nemo_fp8_plugin.tools.harness import ArmRecord, ratio

    @dataclass
    class Step:
        reward: float

    arm = ArmRecord(
        "fp8", steps=[Step(r) for r in (0.0, 0.2, 0.4, 0.6)], step_seconds=[9.0, 1.0, 2.0, 3.0]
    )
    assert arm.series("reward") == [0.0, 0.2, 0.4, 0.6]
    assert arm.mean("reward") == pytest.approx(0.3) and arm.tail_mean("reward") == 0.6
    assert arm.tail_mean("reward", 0.5) == pytest.approx(0.5)
    assert arm.steady_step_s(1) == 2.0 and arm.steady_step_s(5) == 2.5  # at most half left out
    empty = ArmRecord("bf16")
    assert math.isnan(empty.mean("reward")) and empty.steady_step_s() is None
    assert not empty.completed
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(1.0, 0) is None


def test_json_and_png_are_written_whole(tmp_path):
    from nemo_fp8_plugin.tools.harness import pyplot, write_json, write_png

    path = write_json(tmp_path / "r.json", {"path": tmp_path, "x": [1.5]})
    assert json.loads(path.read_text()) == {"path": str(tmp_path), "x": [1.5]}
    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [1, 0])
    png = write_png(tmp_path / "p.png", fig)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.json"]  # no temp files
    assert not pyplot().get_fignums()  # the figure was closed
