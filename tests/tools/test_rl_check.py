"""`nemo-fp8 rl-check --quick`: the robust parts of the end-to-end FP8 RL check.

One quick run (about a minute on two CPU cores) through the CLI, shared by the tests. What
must hold whatever the seed: the BF16 arm's mismatch is tiny; FP8 generation with BF16
training is clearly further off; end-to-end FP8 (the trainer quantizes like the engine)
comes back close to BF16; the FP8 refit payload is about half the BF16 one.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.tools.rl_check import ARMS


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_check") / "quick.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli_main(["rl-check", "--quick", "--quiet", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    data["text"] = text.getvalue()
    data["by_arm"] = {row["arm"]: row for row in data["summary"]}
    return data


def excess(row):
    return row["token_mult_prob_error"] - 1.0


@pytest.mark.slow
def test_every_arm_ran_and_reported(quick):
    assert list(quick["by_arm"]) == list(ARMS)
    for arm in ARMS:
        row = quick["by_arm"][arm]
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["token_mult_prob_error"] >= 1.0 and row["gen_kl_error"] >= -1e-9
        assert 0.0 < row["refit_share"] < 0.5
        assert 0.0 <= row["final_reward"] <= 1.0
        assert len(quick["steps"][arm]) == quick["settings"]["steps"]
        assert f"### arm `{arm}`" in quick["text"]
    assert "### summary" in quick["text"]
    assert quick["environment"]["torch"] and quick["environment"]["threads"] >= 1


@pytest.mark.slow
def test_end_to_end_fp8_mismatch_is_near_bf16_and_generation_only_is_not(quick):
    arms = quick["by_arm"]
    bf16, gen, e2e = excess(arms["bf16"]), excess(arms["fp8-gen"]), excess(arms["fp8-e2e"])
    assert bf16 < 5e-3  # kernel-order noise only
    assert gen > 3 * bf16  # the engine samples from a policy the trainer never sees
    assert e2e < 0.6 * gen  # same quantized weights on both sides
    assert arms["fp8-e2e"]["gen_kl_error"] < arms["fp8-gen"]["gen_kl_error"]


@pytest.mark.slow
def test_paired_first_step(quick):
    """Step 1 of fp8-gen and fp8-e2e scores the very same samples (same engine weights, same
    sampling seed); only the trainer differs, so the comparison is exact, not statistical."""
    gen, e2e = quick["steps"]["fp8-gen"][0], quick["steps"]["fp8-e2e"][0]
    assert gen["reward"] == e2e["reward"]
    assert e2e["token_mult_prob_error"] < gen["token_mult_prob_error"]
    # and the IS arm is fp8-gen until its first (weighted) update
    assert quick["steps"]["fp8-gen-is"][0]["token_mult_prob_error"] == gen["token_mult_prob_error"]


@pytest.mark.slow
def test_fp8_refit_ships_about_half_the_bytes(quick):
    arms = quick["by_arm"]
    assert arms["fp8-gen"]["refit_mib"] < 0.6 * arms["bf16"]["refit_mib"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--arms", "bf16,nope"], "--arms"),
        (["--recipe", "mxfp8"], "--recipe"),
        (["--recipe", "fp8_bogus"], "fp8_bogus"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, args, needle):
    assert cli_main(["rl-check", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
