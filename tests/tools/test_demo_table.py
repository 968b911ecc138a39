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


def _spans(line: str) -> list[tuple[int, int]]:
    """(start, end) of each cell: runs of words with single spaces inside, two or more apart."""
    import re

    return [m.span() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_the_header_lines_up_with_the_rows():
    """Each header stands over its column, two spaces at least from the next (the old header
    ran "final loss gap vs BF16 step time vs BF16 ..." together)."""
    slow = arm("nvfp4", 0.3, 0.33, 1.0)
    slow.eval_loss = 2.1234
    rows = D.summarize([arm("bf16", 0.1, 0.2, 0.8), arm("fp8_blockwise", 0.12, 0.21, 1.1), slow])
    rows[1]["completed"], rows[1]["steps_done"] = False, 7
    header, *body, note = D.render_table(rows).splitlines()
    heads = _spans(header)
    assert [header[a:b] for a, b in heads] == [h for h, _ in D.TABLE_COLUMNS]
    for line in body:
        cells = _spans(line.split("  (stopped")[0])
        assert len(cells) == len(heads), line
        assert cells[0][0] == heads[0][0]  # the recipe names are left-aligned under "recipe"
        assert [b for _, b in cells[1:]] == [b for _, b in heads[1:]], (header, line)
    assert body[1].endswith("(stopped after 7 steps)") and "+6.17%" in body[2]
    assert note.startswith("load average up to")


def test_the_plot_has_the_gap_to_bf16_beside_the_curves():
    def trained(name, losses):
        r = D.ArmResult(name=name, completed=True)
        r.steps = list(losses)
        return r

    base = [5.0 - 0.1 * i for i in range(12)]
    results = [
        trained("bf16", base),
        trained("fp8_blockwise", [b + 0.01 for b in base]),
        trained("nvfp4", [b + 0.05 * i for i, b in enumerate(base)]),
    ]
    gaps = D.gap_curves(results)
    assert list(gaps) == ["fp8_blockwise", "nvfp4"]
    assert gaps["fp8_blockwise"] == pytest.approx([0.01] * 12)
    assert gaps["nvfp4"][0] == 0.0 and gaps["nvfp4"][11] == pytest.approx(0.05 * 6.5)  # 2..11
    assert D.gap_curves(results[1:]) == {}  # no BF16 arm, no gap
    fig = D.plot_curves(results)
    try:
        loss_ax, gap_ax = fig.axes
        assert [line.get_label() for line in loss_ax.get_lines()] == [
            "bf16",
            "fp8_blockwise",
            "nvfp4",
        ]
        drawn = {line.get_label(): list(line.get_ydata()) for line in gap_ax.get_lines()}
        assert drawn["fp8_blockwise"] == pytest.approx(gaps["fp8_blockwise"])
        assert drawn["nvfp4"] == pytest.approx(gaps["nvfp4"])
        assert "bf16" not in drawn and "gap to BF16" in gap_ax.get_title()
    finally:
        D.pyplot().close(fig)
