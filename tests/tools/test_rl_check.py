"""`nemo-fp8 rl-check --quick`: the robust parts of the end-to-end FP8 RL check.

One quick run (2 seeds, 8 small steps, two worker processes; about a minute on two CPU
cores) through the CLI, shared by the tests. What must hold whatever the seed: the BF16
arm's mismatch is tiny; FP8 generation with BF16 training is clearly further off; end to end
(the trainer quantizes the same weights, with TE's numerics where the engine uses vLLM's)
comes back closer; the FP8 KV cache adds mismatch of its own; every cost is measured; the
FP8 refit payload is about half the BF16 one. Whether BF16 learns is the full run's claim
(docs/rl.md), not the quick run's.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.tools import rl_check
from nemo_fp8_plugin.tools.rl_check import ARMS, QUICK, run_seed, t_interval

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_check") / "quick.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli_main(["rl-check", "--quick", "--quiet", "--jobs", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    data["text"] = text.getvalue()
    data["png"] = out.with_suffix(".png").read_bytes()
    data["by_arm"] = data["summary"]["arms"]
    data["run"] = {(r["arm"], r["seed"]): r for r in data["runs"]}
    return data


def excess(row):
    return row["token_mult_prob_error"]["mean"] - 1.0


@pytest.mark.slow
def test_every_arm_and_seed_ran_and_reported(quick):
    assert quick["arms"] == list(ARMS)
    assert len(ARMS) == 6
    seeds = list(range(QUICK.seeds))
    assert quick["settings"]["seeds"] == len(seeds) >= 2
    for arm in ARMS:
        row = quick["by_arm"][arm]
        assert row["seeds"] == seeds
        for key in ("final_reward", "start_reward", "gain", "token_mult_prob_error"):
            stats = row[key]
            assert stats["n"] == len(seeds)
            assert math.isfinite(stats["mean"]) and math.isfinite(stats["ci95"]), (arm, key)
            assert stats["ci95"] >= 0
        assert 0.0 <= row["final_reward"]["mean"] <= 1.0
        for seed in seeds:
            run = quick["run"][(arm, seed)]
            assert len(run["steps"]) == quick["settings"]["steps"]
        assert f"| {arm} |" in quick["text"]
    assert quick["by_arm"]["bf16"]["final_vs_bf16"] is None
    assert quick["by_arm"]["fp8-gen"]["final_vs_bf16"]["n"] == len(seeds)
    assert quick["environment"]["torch"] and quick["environment"]["threads"] >= 1


@pytest.mark.slow
def test_png_has_the_curves(quick):
    assert quick["png"].startswith(PNG_MAGIC)
    assert 5_000 < len(quick["png"]) < 400_000


@pytest.mark.slow
def test_mismatch_ordering(quick):
    arms = quick["by_arm"]
    bf16, gen, e2e = excess(arms["bf16"]), excess(arms["fp8-gen"]), excess(arms["fp8-e2e"])
    assert bf16 < 5e-3  # kernel-order noise only
    assert gen > 3 * bf16  # the engine samples from a policy the trainer never sees
    assert e2e < 0.8 * gen  # same quantized weights on both sides
    assert e2e > bf16  # but vLLM's activation numerics are not TE's: not zero by construction
    assert arms["fp8-e2e"]["gen_kl_error"]["mean"] < arms["fp8-gen"]["gen_kl_error"]["mean"]


@pytest.mark.slow
def test_paired_first_step(quick):
    """Step 1 of arms that share an engine scores the very same samples (same engine weights,
    same sampling seed); only the trainer or the loss differs, so the comparison is exact."""
    for seed in range(QUICK.seeds):
        step = {arm: quick["run"][(arm, seed)]["steps"][0] for arm in ARMS}
        assert step["fp8-gen"]["reward"] == step["fp8-e2e"]["reward"]
        assert step["fp8-e2e"]["token_mult_prob_error"] < step["fp8-gen"]["token_mult_prob_error"]
        # an IS arm is its plain twin until its first (weighted) update
        for plain, weighted in (("fp8-gen", "fp8-gen-is"), ("fp8-e2e", "fp8-e2e-is")):
            assert step[weighted]["token_mult_prob_error"] == step[plain]["token_mult_prob_error"]
            assert step[plain]["sampling_importance_ratio"] == 1.0
            assert step[weighted]["sampling_importance_ratio"] != 1.0
        # the FP8 KV cache changes what the engine computes from the very first token
        kv, e2e_is = step["fp8-e2e-is-kv"], step["fp8-e2e-is"]
        assert kv["token_mult_prob_error"] != e2e_is["token_mult_prob_error"]


@pytest.mark.slow
def test_costs_are_measured(quick):
    arms = quick["by_arm"]
    for arm in ARMS:
        shares = arms[arm]["shares"]
        assert 0.0 < shares["generate"] < 1.0 and 0.0 < shares["train"] < 1.0
        assert 0.0 < shares["load"] < 0.5
        assert sum(shares.values()) <= 1.0 + 1e-9
        quantized = arm != "bf16"
        assert (shares["quantize"] > 0.0) == quantized, arm
        with_kv = arm.endswith("-kv")
        assert (shares["kv_calibration"] > 0.0) == with_kv, arm
        assert (shares["kv_refresh"] > 0.0) == with_kv, arm
    assert arms["fp8-gen"]["refit_mib"] < 0.6 * arms["bf16"]["refit_mib"]


@pytest.mark.slow
def test_kv_scales_were_calibrated_and_refreshed(quick):
    for seed in range(QUICK.seeds):
        scales = quick["run"][("fp8-e2e-is-kv", seed)]["kv_scales"]
        names = {f"model.layers.{i}.self_attn.attn.{r}_scale" for i in (0, 1) for r in "kv"}
        assert set(scales) == names
        # calibrated, not the initial 1.0: amax * 1.05 / 448 of activations of order 1-10
        assert all(1e-4 < v < 0.2 for v in scales.values()), scales
        assert not quick["run"][("fp8-e2e-is", seed)]["kv_scales"]


@pytest.mark.slow
def test_worker_processes_give_the_records_of_one_process(quick):
    settings = rl_check.with_overrides(QUICK, steps=3)
    (local,) = run_seed(settings, 1, ("bf16",))
    remote = quick["run"][("bf16", 1)]
    assert local.start_reward == remote["start_reward"]
    for mine, theirs in zip(local.steps, remote["steps"]):
        assert mine.reward == theirs["reward"]
        assert mine.token_mult_prob_error == theirs["token_mult_prob_error"]


def test_t_interval():
    # mean 2, sd 1, n 3: half-width t(0.975, 2) * 1 / sqrt(3)
    stats = t_interval([1.0, 2.0, 3.0])
    assert stats["mean"] == 2.0 and stats["n"] == 3
    assert stats["se"] == pytest.approx(1 / math.sqrt(3))
    assert stats["ci95"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert math.isnan(t_interval([0.5])["ci95"])
    assert rl_check.t_quantile_975(60) == pytest.approx(2.000298, abs=1e-3)
    assert rl_check.t_quantile_975(31) == pytest.approx(2.039513, abs=1e-3)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--arms", "bf16,nope"], "--arms"),
        (["--arms", ""], "--arms"),
        (["--arms", "bf16,bf16"], "--arms"),
        (["--recipe", "mxfp8"], "--recipe"),
        (["--recipe", "fp8_bogus"], "fp8_bogus"),
        (["--steps", "0"], "--steps"),
        (["--steps", "-3"], "--steps"),
        (["--steps", "1e3"], "--steps"),
        (["--steps", "1000001"], "--steps"),
        (["--seeds", "0"], "--seeds"),
        (["--seeds", "-1"], "--seeds"),
        (["--seeds", "65"], "--seeds"),
        (["--seeds", "two"], "--seeds"),
        (["--seed", "-1"], "--seed"),
        (["--jobs", "0"], "--jobs"),
        (["--generation-numerics", "cuda"], "--generation-numerics"),
    ],
)
def test_bad_arguments_are_one_line_errors_before_any_work(monkeypatch, capsys, args, needle):
    def no_work(*a, **k):
        raise AssertionError("the check started before its arguments were checked")

    monkeypatch.setattr(rl_check, "run_check", no_work)
    assert cli_main(["rl-check", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_unwritable_outputs_are_refused_before_any_work(monkeypatch, capsys, tmp_path, flag):
    def no_work(*a, **k):
        raise AssertionError("the check started before its outputs were checked")

    monkeypatch.setattr(rl_check, "run_check", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad in (str(blocker / "out"), str(tmp_path)):  # under a file; a directory
        assert cli_main(["rl-check", "--quick", flag, bad]) == 2
        err = capsys.readouterr().err.strip()
        assert flag in err and "\n" not in err


def test_the_default_png_next_to_the_json_is_checked_too(monkeypatch, capsys, tmp_path):
    def no_work(*a, **k):
        raise AssertionError("the check started before its outputs were checked")

    monkeypatch.setattr(rl_check, "run_check", no_work)
    (tmp_path / "out.png").mkdir()  # the derived PNG path is a directory
    assert cli_main(["rl-check", "--json", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--png" in err and "\n" not in err
    assert (
        cli_main(["rl-check", "--json", str(tmp_path / "x.png"), "--png", str(tmp_path / "x.png")])
        == 2
    )
    assert "same file" in capsys.readouterr().err
