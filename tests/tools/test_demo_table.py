"""The demo's table and thread choice, in process (no training): the step ratios come with
CPU time and the load they were measured at, and torch's threads follow the load."""

from __future__ import annotations

import pytest

from nemo_fp8_plugin.tools import demo as D


def arm(name, wall, cpu, load):
    r = D.ArmResult(name=name, eval_loss=2.0, completed=True)
    r.step_seconds = [9.0] * 5 + [wall] * 5  # the first steps are left out
    r.step_cpu_seconds = [9.0] * 5 + [cpu] * 5
    r.load_average = load
    return r


def test_rows_carry_wall_and_cpu_ratios_and_the_load():
    rows = D.summarize([arm("bf16", 0.1, 0.2, 0.8), arm("mxfp8", 0.12, 0.21, 1.1)])
    mx = rows[1]
    assert mx["step_time_vs_bf16"] == pytest.approx(1.2)
    assert mx["step_cpu_vs_bf16"] == pytest.approx(1.05)
    assert mx["load_average"] == 1.1
    text = D.render_table(rows)
    assert "CPU time vs BF16" in text and "1.20x" in text and "1.05x" in text
    assert (
        text.splitlines()[-1]
        == "load average up to 1.10 during the run: the step-time ratios count"
    )


def test_a_busy_run_says_its_ratios_do_not_count():
    rows = D.summarize([arm("bf16", 0.1, 0.2, 0.8), arm("nvfp4", 0.3, 0.3, 7.5)])
    assert D.load_note(rows).endswith("do not count (they need load < 1.5)")
    assert "unknown" in D.load_note([{"load_average": None}])


def test_threads_follow_the_environment_and_the_load(monkeypatch):
    from nemo_fp8_plugin.numerics import _cpu

    monkeypatch.delenv("NEMO_FP8_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_cpu, "available_cores", lambda: 2)
    monkeypatch.setattr(D, "load_average", lambda: 9.0)
    assert D.pick_threads() == (1, "2 cores at load 9.00")
    monkeypatch.setattr(D, "load_average", lambda: 0.4)
    assert D.pick_threads()[0] == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert D.pick_threads() == (3, "$OMP_NUM_THREADS")
