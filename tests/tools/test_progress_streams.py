"""Progress on a redirected stream: ``rl-check``'s and ``demo``'s tqdm bars draw
only on a terminal; in a log file they write no carriage-return updates (one rl-check log held
80 of them), and ``bench`` prints one plain line per case.

Each check runs the tool's own loop with stderr pointed at a real file, and again at a stream
that says it is a terminal, where the bar must show (so the file case cannot pass by drawing
nothing at all).
"""

from __future__ import annotations

import io
import sys

import pytest


class Terminal(io.StringIO):
    """A text stream that reports itself as a terminal, as tqdm asks (``isatty``)."""

    def isatty(self) -> bool:
        return True


def _stderr_to(monkeypatch, tmp_path, terminal: bool):
    # newline="": read back the bytes as written (text mode would turn "\r" into "\n")
    path = tmp_path / "stderr.log"
    stream = Terminal() if terminal else open(path, "w+", encoding="utf-8", newline="")
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def _written(stream) -> str:
    stream.flush()
    stream.seek(0)
    text = stream.read()
    stream.close()
    return text


@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_rl_check_bar_only_on_a_terminal(monkeypatch, tmp_path, terminal):
    from nemo_fp8_plugin.tools import rl_check

    steps = []

    def few_ticks(settings, seed, arms, tick):  # the experiment itself is tested elsewhere
        for arm in arms:
            for step in range(settings.steps):
                tick(f"{arm} step {step}")
                steps.append(step)
        return []

    monkeypatch.setattr(rl_check, "run_seed", few_ticks)
    stream = _stderr_to(monkeypatch, tmp_path, terminal)
    rl_check.run_check(rl_check.QUICK, arms=("bf16", "fp8-e2e"), progress=True)
    text = _written(stream)
    assert steps, "the loop ran"
    if terminal:
        assert "\r" in text and "rl-check" in text
    else:
        assert text.count("\r") == 0, text[:500]


@pytest.mark.host  # trains a (tiny) megatron-core GPT
@pytest.mark.slow  # ~15 s: importing megatron-core
@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_demo_bar_only_on_a_terminal(monkeypatch, tmp_path, terminal):
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.tools import demo
    from nemo_fp8_plugin.tools.demo.data import ByteBatches, stdlib_corpus
    from nemo_fp8_plugin.tools.demo.model import GPTSettings

    gpt = GPTSettings(num_layers=1, hidden_size=128, ffn_hidden_size=128, seq_length=16)
    train = demo.TrainSettings(steps=3, micro_batch_size=2, warmup_steps=1, eval_batches=1)
    data = ByteBatches(stdlib_corpus(100_000), gpt.seq_length, train.micro_batch_size, 0, 0.1, 1)
    stream = _stderr_to(monkeypatch, tmp_path, terminal)
    result = demo.run_arm(
        demo.ArmResult(name="fp8_blockwise"), get_recipe("fp8_blockwise"), gpt, train, data
    )
    text = _written(stream)
    assert result.completed and len(result.losses) == 3
    if terminal:
        assert "\r" in text and "fp8_blockwise" in text
    else:
        assert text.count("\r") == 0, text[:500]
