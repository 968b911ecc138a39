"""`nemo-fp8 demo`, the main job: a real megatron-core GPT trained on CPU per recipe.

Short runs (`--steps`) of the real command in a subprocess; the full default run is the
README's first command (figures in docs/performance.md).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# every test starts `nemo-fp8 demo`, which trains a megatron-core GPT or fails after importing it
pytestmark = [pytest.mark.host, pytest.mark.slow]

BIN = Path(sys.executable).parent


def demo(*args, **kw):
    return subprocess.run(
        [str(BIN / "nemo-fp8"), "demo", "--no-progress", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        **kw,
    )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = demo("--steps", "60", "--recipes", "fp8_blockwise,fp8_current,mxfp8", "--out", out)
    return proc, out


def test_table_files_and_loss_gap(short_run):
    proc, out = short_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    rows = {r["recipe"]: r for r in report["rows"]}
    assert list(rows) == ["bf16", "fp8_blockwise", "fp8_current", "mxfp8"]
    assert report["recipe_requested"] == "fp8_blockwise" and report["interrupted"] is False
    assert report["environment"]["torch"] and report["environment"]["threads"] >= 1
    for name, row in rows.items():
        assert row["completed"] and row["steps_done"] == 60
        assert abs(row["loss_gap_vs_bf16"]) < 0.05, (name, row)
        assert row["step_time_vs_bf16"] > 0
        assert len(report["curves"][name]) == 60
    # the BF16 arm trains: loss falls well below ln(256) = 5.55 of a uniform byte model
    assert rows["bf16"]["final_loss"] < 4.0
    # fp8_current keeps the first and last layer (4 linears each) plus the head in BF16
    assert rows["fp8_current"]["bf16_modules"] == 9
    assert rows["fp8_blockwise"]["bf16_modules"] == 1
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in rows:
        assert name in proc.stdout
    assert "gap vs BF16" in proc.stdout and str(out) in proc.stdout
    # the step ratios with the load they were measured at, CPU time beside wall time
    assert "CPU time vs BF16" in proc.stdout and "load average up to" in proc.stdout
    assert report["threads"] >= 1 and report["threads_reason"] and report["quiet_load"] == 1.5
    for row in rows.values():
        assert row["step_cpu_vs_bf16"] > 0 and row["load_average"] is not None


def test_ctrl_c_leaves_a_partial_valid_result(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [
            str(BIN / "nemo-fp8"),
            "demo",
            "--no-progress",
            "--steps",
            "40",
            "--recipes",
            "fp8_blockwise,mxfp8",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while not (out / "results.json").exists():  # written once the BF16 arm is done
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    report = json.loads((out / "results.json").read_text())
    assert report["interrupted"] is True
    rows = {r["recipe"]: r for r in report["rows"]}
    assert rows["bf16"]["completed"]
    assert not all(r["completed"] for r in report["rows"])
    assert "interrupted" in stdout
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no half-written files


@pytest.mark.parametrize(
    "text, key",
    [
        ("precision: fp8_blockwise\nmodel: {num_layers: two}\n", "model.num_layers"),
        ("precision: fp8_blockwise\ntrain: {stepz: 3}\n", "train.stepz"),
        ("precision: fp8_bogus\n", "precision"),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path, text, key):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(text)
    proc = demo(cfg, "--steps", "1", "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert key in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_unknown_recipe_on_the_command_line(tmp_path):
    proc = demo("--recipes", "fp8_blokwise", "--steps", "1", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "did you mean 'fp8_blockwise'" in proc.stderr
