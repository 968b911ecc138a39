"""`nemo-fp8 rl-check --quick`: the robust parts of the end-to-end FP8 RL check.

One smoke run (2 seeds, 3 small steps, answers of 8 tokens, two worker processes; about a
minute on two CPU cores) through the CLI, shared by the tests. What must hold whatever the
seed: the BF16 arm's mismatch is tiny; FP8 generation with BF16 training is clearly further
off; end to end comes back closer; the FP8 KV cache adds mismatch of its own; every cost is
measured; the trainer-side FP8 refit payload is about half the BF16 one NeMo RL sends;
evaluation prompts are held out; the attribution's baseline is the step's recorded
mismatch; the same run with two threads in one process gives the same records. Whether BF16
learns, and the reward comparison, are the full run's claims (docs/rl.md), not the smoke
run's. The statistics (verdicts, power, nightly checks) are tested on inputs of known value.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics

import pytest
import torch

from conftest import LLAMA_LINEARS
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.numerics import fused_mode
from nemo_fp8_plugin.tools import rl_check
from nemo_fp8_plugin.tools import rl_check_report as report
from nemo_fp8_plugin.tools import rl_check_stats as stats
from nemo_fp8_plugin.tools.rl_check import ARMS, QUICK
from nemo_fp8_plugin.tools.rl_check_stats import t_interval

NEMO_RL_ARMS = [a for a in ARMS if rl_check.ARM_SPECS[a].fp8_generation and a != "fp8-e2e-te-refit"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_check") / "quick.json"
    text = io.StringIO()
    # the worker processes start at one torch thread (the thread test compares at two)
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(text):
        env.setenv("OMP_NUM_THREADS", "1")
        assert cli_main(["rl-check", "--quick", "--quiet", "--jobs", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    data["text"] = text.getvalue()
    data["png"] = out.with_suffix(".png").read_bytes()
    data["by_arm"] = data["summary"]["arms"]
    data["run"] = {(r["arm"], r["seed"]): r for r in data["runs"]}
    return data


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def excess(row):
    return row["token_mult_prob_error"]["mean"] - 1.0


@pytest.mark.slow
def test_every_arm_and_seed_ran_and_reported(quick):
    assert quick["arms"] == list(ARMS)
    assert len(ARMS) == 7
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
    # the CPU's vector ISA, in the JSON and on the first line of the tables
    isa = quick["environment"]["isa"]
    assert isa and f"(CPU ISA {isa})" in quick["text"].splitlines()[0]


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
    assert e2e < 0.8 * gen  # the trainer runs the FP8 numerics too
    # Not zero by construction: E4M3 rounding amplifies the two sides' BF16 attention-order
    # noise (an activation near a rounding boundary lands on different codes), which stays
    # even with identical quantizers on both sides (--generation-numerics trainer keeps about
    # 90% of this excess); vLLM's quotient vs TE's product and NeMo RL's worker-side weight
    # quantization add only a little.
    assert e2e > bf16
    assert arms["fp8-e2e"]["gen_kl_error"]["mean"] < arms["fp8-gen"]["gen_kl_error"]["mean"]


@pytest.mark.slow
def test_paired_first_step(quick):
    """Step 1 of arms that share an engine scores the very same samples (same engine weights,
    same sampling seed); only the trainer or the loss differs, so the comparison is exact."""
    for seed in range(QUICK.seeds):
        step = {arm: quick["run"][(arm, seed)]["steps"][0] for arm in ARMS}
        assert step["fp8-gen"]["reward"] == step["fp8-e2e"]["reward"]
        # the same trainer, engines with other weights (NeMo RL's quantizer is not TE's):
        # the mismatch differs at some step (a step's weights may quantize alike)
        te, nemo = (quick["run"][(arm, seed)]["steps"] for arm in ("fp8-e2e-te-refit", "fp8-e2e"))
        assert [t["token_mult_prob_error"] for t in te] != [
            t["token_mult_prob_error"] for t in nemo
        ]
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
        # NeMo RL quantizes in the engine (its load); only the TE refit quantizes on the trainer
        on_trainer = rl_check.ARM_SPECS[arm].weight_path == "trainer" and arm != "bf16"
        assert (shares["quantize"] > 0.0) == on_trainer, arm
        with_kv = arm.endswith("-kv")
        assert (shares["kv_calibration"] > 0.0) == with_kv, arm
        assert (shares["kv_refresh"] > 0.0) == with_kv, arm
    assert arms["fp8-e2e-te-refit"]["refit_mib"] < 0.6 * arms["bf16"]["refit_mib"]
    assert arms["fp8-gen"]["refit_mib"] == arms["bf16"]["refit_mib"]  # NeMo RL sends BF16
    # That the engine quantizes what NeMo RL sends is tested on its weights (below), not by
    # comparing two load times of a few milliseconds that a busy machine's scheduler sets.


@pytest.mark.slow
def test_kv_scales_were_calibrated_and_refreshed(quick):
    for seed in range(QUICK.seeds):
        scales = quick["run"][("fp8-e2e-is-kv", seed)]["kv_scales"]
        # include_q=True, as NeMo RL's GRPO loop calibrates: q scales too
        names = {f"model.layers.{i}.self_attn.attn.{r}_scale" for i in (0, 1) for r in "qkv"}
        assert set(scales) == names
        # calibrated, not the initial 1.0: amax * 1.05 / 448 of activations of order 1-10
        assert all(1e-4 < v < 0.2 for v in scales.values()), scales
        assert not quick["run"][("fp8-e2e-is", seed)]["kv_scales"]


def _records(run: dict) -> dict:
    """Everything a seed's arm produced but its timings."""
    timing = {"step_s", "generate_s", "train_s", "quantize_s", "load_s"} | {
        "kv_calibration_s",
        "kv_refresh_s",
    }
    return {
        "start": run["start_reward"],
        "final": run["final_reward"],
        "kv_scales": run["kv_scales"],
        "attribution": run["attribution"],
        "steps": [{k: v for k, v in st.items() if k not in timing} for st in run["steps"]],
    }


@pytest.mark.slow
def test_two_threads_in_one_process_give_the_records_of_one_thread_per_worker(quick):
    """The smoke run (2 seeds x 3 steps) again, in this process at two torch threads:
    bit-identical per-seed records to the fixture's (two worker processes started at one
    thread). Two threads do change these sums (a warm-up alone differs), so this holds only
    because every seed runs at one thread whatever the caller's."""
    assert QUICK.steps == 3 and QUICK.seeds == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        again = rl_check.run_check(QUICK, jobs=1)
    finally:
        torch.set_num_threads(threads)
    for run in report.to_json(again)["runs"]:
        theirs = quick["run"][(run["arm"], run["seed"])]
        assert _records(run) == _records(theirs), (run["arm"], run["seed"])


def test_t_interval():
    # mean 2, sd 1, n 3: half-width t(0.975, 2) * 1 / sqrt(3)
    got = t_interval([1.0, 2.0, 3.0])
    assert got["mean"] == 2.0 and got["n"] == 3
    assert got["se"] == pytest.approx(1 / math.sqrt(3))
    assert got["ci95"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert math.isnan(t_interval([0.5])["ci95"])
    assert stats.t_quantile_975(60) == pytest.approx(2.000298, abs=1e-3)
    assert stats.t_quantile_975(31) == pytest.approx(2.039513, abs=1e-3)


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


# ------------------------------------------------------------------ held-out prompts, bounds, attribution


@pytest.mark.slow
def test_evaluation_prompts_are_held_out(quick):
    assert quick["summary"]["eval_disjoint"] is True
    for run in quick["runs"]:
        assert run["eval_overlap"] == 0, (run["arm"], run["seed"])


@pytest.mark.parametrize("digits", [3, 16])
def test_prompt_split_counts_what_trained_not_how_it_was_drawn(digits):
    from nemo_fp8_plugin.tools.rl_check_model import PromptSplit, RunningSumTask

    task = RunningSumTask(digits)
    gen = torch.Generator().manual_seed(0)
    split = PromptSplit(task, 200, gen)
    assert len(set(task.decode(split.eval).tolist())) == 200  # distinct
    assert torch.equal(task.encode(task.decode(split.eval)), split.eval)
    drawn = split.train(5000, gen)
    split.note(drawn)
    assert split.overlap() == 0
    assert not set(task.decode(drawn).tolist()) & set(task.decode(split.eval).tolist())
    split.note(torch.cat([split.eval[3:5], task.answers(split.eval[3:5])], dim=1))
    assert split.overlap() == 2  # two evaluation prompts trained on: caught
    if digits == 16:  # drawn from all 10**16 prompts, not from a small corner of them
        assert int(task.decode(split.eval).max()) > 10**15


def test_the_task_is_a_running_sum_where_one_wrong_token_derails_the_rest():
    from nemo_fp8_plugin.tools.rl_check_model import RunningSumTask

    task = RunningSumTask(16)
    prompts = task.prompts(32, torch.Generator().manual_seed(3))
    digits = prompts[:, 1:17]
    answers = task.answers(prompts)
    assert answers.shape == (32, 16)
    assert torch.equal(answers[:, 0], digits[:, 0])
    assert torch.equal(answers[:, 1:], (answers[:, :-1] + digits[:, 1:]) % 10)
    assert torch.equal(task.reward(prompts, answers), torch.ones(32))
    # a policy that adds each digit to its own previous token, with one slip at position k:
    # every later digit is wrong too, so the reward is k / 16
    for k in (0, 5, 15):
        out = answers.clone()
        out[:, k] = (out[:, k] + 1) % 10
        for i in range(k + 1, 16):
            out[:, i] = (out[:, i - 1] + digits[:, i]) % 10
        assert torch.equal(task.reward(prompts, out), torch.full((32,), k / 16))


@pytest.mark.slow
def test_nightly_bounds_are_reported_per_arm(quick):
    for arm in ARMS:
        bound = quick["by_arm"][arm]["nightly_bound"]
        assert bound["bound"] == (2.0 if arm.endswith("-kv") else 1.1)
        errors = [
            st["token_mult_prob_error"]
            for r in quick["runs"]
            if r["arm"] == arm
            for st in r["steps"]
        ]
        assert bound["steps"] == len(errors)
        assert bound["steps_above"] == sum(e >= bound["bound"] for e in errors)
        assert bound["max"] == max(errors)
        assert 0 <= bound["seeds_passing"] <= bound["seeds"] == QUICK.seeds
    assert "NeMo RL's check: seeds passing" in quick["text"]


def _result(
    finals: dict[str, list[float]], errors: dict[str, list[float]] | None = None, smoke=False
):
    """A CheckResult of known values (no run): final rewards per arm and seed, step errors."""
    s = rl_check.with_overrides(QUICK, seeds=len(finals["bf16"]), smoke=smoke)
    runs = []
    for arm, values in finals.items():
        for seed, final in enumerate(values):
            r = rl_check.SeedArmResult(arm, seed, start_reward=0.4, final_reward=final)
            r.eval_overlap = 0
            series = (errors or {}).get(arm, [1.0])
            if isinstance(series[0], list):  # one list per seed
                series = series[seed]
            for k, e in enumerate(series):
                r.steps.append(
                    rl_check.StepRecord(k, 0.5, e, 0.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0, 0, 0, 0, 1)
                )
            runs.append(r)
    return rl_check.CheckResult(s, tuple(finals), runs)


def test_power_analysis_seed_counts_for_a_known_sd():
    # paired SD 0.033 (today's): a 95% half-width <= 0.03 takes 8 seeds, 80% power 12
    p = stats.power_analysis(0.033, 0.03, seeds=5)
    assert p["seeds_to_resolve"] == 8 and p["seeds_for_power"] == 12
    assert p["half_width"] == pytest.approx(2.776445 * 0.033 / math.sqrt(5))
    assert p["resolves"] is False
    assert stats.power_analysis(0.033, 0.03, seeds=8)["resolves"] is True
    # half the SD: a quarter of the seeds, about
    assert stats.power_analysis(0.0165, 0.03)["seeds_for_power"] == 5
    assert stats.power_analysis(float("nan"))["seeds_to_resolve"] is None


def test_sd_upper_bound_of_a_known_case():
    # chi-square 10% quantile with 7 df is 2.8331: the 90% upper bound is sd * sqrt(7 / 2.8331)
    assert stats.sd_upper_bound(1.0, 7) == pytest.approx(math.sqrt(7 / 2.8331), rel=1e-3)
    assert stats.sd_upper_bound(0.02, 3) > stats.sd_upper_bound(0.02, 30) > 0.02
    assert math.isnan(stats.sd_upper_bound(0.02, 0))
    # the default's measured SD, 0.0220 over 8 seeds: 5 seeds resolve 0.03, 8 at its bound
    upper = stats.sd_upper_bound(0.0220, 7)
    assert stats.power_analysis(0.0220, 0.03)["seeds_to_resolve"] == 5
    assert stats.power_analysis(upper, 0.03)["seeds_to_resolve"] == 8


@pytest.mark.slow
def test_the_json_records_the_threads_each_seed_ran_at(quick):
    """This process's torch threads are not what the seeds ran at (one each, in --jobs
    processes)."""
    assert quick["environment"]["seed_threads"] == 1
    assert quick["environment"]["seed_processes"] == 2


def test_a_json_document_gives_back_its_result(quick):
    """result_from_json rebuilds the records: the summary recomputed from them is the run's."""
    doc = {k: quick[k] for k in ("settings", "arms", "summary", "runs")}
    again = report.summarize(report.result_from_json(doc))
    assert json.dumps(again, sort_keys=True) == json.dumps(quick["summary"], sort_keys=True)


def test_the_summary_states_power_from_the_runs_own_paired_sd():
    # paired differences with SD exactly 0.033 in one arm, 0 in the other
    d = [0.033 * x for x in (-1.5, -0.5, 0.5, 1.5)]
    d = [x / (statistics.stdev(d) / 0.033) for x in d]
    base = [0.6, 0.5, 0.7, 0.65]
    result = _result({"bf16": base, "fp8-gen": [b + x for b, x in zip(base, d)], "fp8-e2e": base})
    summary = report.summarize(result)
    assert summary["arms"]["fp8-gen"]["final_vs_bf16_sd"] == pytest.approx(0.033)
    per_arm = summary["power"]["per_arm"]["fp8-gen"]
    assert per_arm["seeds_for_power"] == 12 and per_arm["resolves"] is False
    pooled = summary["power"]["pooled"]
    assert pooled["paired_sd"] == pytest.approx(0.033 / math.sqrt(2))
    text = report.render_tables(result, summary)
    assert "does NOT resolve a 0.03 gap" in text


def test_bound_shares_of_known_steps():
    errors = {"bf16": [1.0, 1.0], "fp8-gen": [1.05, 1.1, 1.2, 1.0], "fp8-e2e-is-kv": [1.5, 2.0]}
    result = _result({a: [0.5] for a in errors}, errors)
    arms = report.summarize(result)["arms"]
    assert arms["fp8-gen"]["nightly_bound"]["steps_above"] == 2  # 1.1 is not < 1.1
    assert arms["fp8-gen"]["nightly_bound"]["share_above"] == 0.5
    assert arms["fp8-e2e-is-kv"]["nightly_bound"]["steps_above"] == 1  # bound 2.0
    assert arms["bf16"]["nightly_bound"]["share_above"] == 0.0


_LINEARS = LLAMA_LINEARS


@pytest.mark.slow
def test_shared_start_evaluations_are_each_arms_own(quick):
    """Arms with the same start engine share one start evaluation; each arm run alone (so
    it evaluates its own engine) gives the very value the shared run reported."""
    from nemo_fp8_plugin.registry import get_recipe

    settings = rl_check.with_overrides(QUICK, steps=1, attribution_step=None)
    for seed in range(QUICK.seeds):
        start = {arm: quick["run"][(arm, seed)]["start_reward"] for arm in ARMS}
        assert start["fp8-gen"] == start["fp8-e2e"] == start["fp8-e2e-is"]
    with _one_thread():  # as run_seed computes
        template, task, _, _ = rl_check._template(settings, 1)  # the seed's warm-up, once
        spec = get_recipe(settings.recipe)
        for arm in ("fp8-e2e-is", "fp8-e2e-te-refit", "fp8-e2e-is-kv"):
            with fused_mode(False):
                alone = rl_check.run_arm(arm, template, task, settings, spec, 1)
            assert alone.start_reward == quick["run"][(arm, 1)]["start_reward"], arm


@pytest.mark.slow
def test_attribution_runs_on_the_first_seeds_only(quick):
    assert QUICK.attribution_seeds == 1
    assert all(quick["run"][(arm, 0)]["attribution"] for arm in NEMO_RL_ARMS)
    assert not any(quick["run"][(arm, 1)]["attribution"] for arm in ARMS)


@pytest.mark.slow
def test_attribution_baseline_is_the_recorded_step(quick):
    step = QUICK.steps - 1  # attribution_step -1
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for arm in ARMS:
        for seed in range(QUICK.attribution_seeds):
            run = quick["run"][(arm, seed)]
            rows = run["attribution"]
            if not rl_check.ARM_SPECS[arm].fp8_generation:
                assert rows == []
                continue
            assert rows[0]["bf16"] == "none"
            recorded = run["steps"][step]["token_mult_prob_error"]
            assert rows[0]["token_mult_prob_error"] == pytest.approx(recorded, abs=1e-6)
            names = {r["bf16"] for r in rows[1:]}
            expected = (
                kinds | {"layer.0", "layer.1"} | ({"kv_cache"} if arm.endswith("-kv") else set())
            )
            assert names == expected
            # each candidate names the FP8 linears it keeps in BF16 (what analyze reads)
            mods = {r["bf16"]: set(r["modules"]) for r in rows}
            assert mods["none"] == set() and mods.get("kv_cache", set()) == set()
            assert mods["layer.1"] == {f"model.layers.1.{k}" for k in _LINEARS}
            assert mods["v_proj"] == {f"model.layers.{i}.self_attn.v_proj" for i in (0, 1)}
            key = "both_sides_removed" if rl_check.ARM_SPECS[arm].fp8_training else "removed"
            ranked = [r[key] for r in rows[1:]]
            assert ranked == sorted(ranked, reverse=True)
    # How much each candidate removes is a figure of the CPU's rounding (a smoke run's last
    # step has a small excess, so its shares swing): the exact facts of the attribution are
    # tested on an engine of known layout below.
    assert "Mismatch attribution at step" in quick["text"]


@pytest.mark.parametrize("arm", ["fp8-gen", "fp8-e2e"])
def test_a_candidate_holding_every_fp8_linear_gives_the_bf16_mismatch(arm):
    """Exact facts of the attribution, the same on any CPU: with FP8 linears in layer 0 only,
    keeping ``layer.0`` in BF16 leaves an all-BF16 engine, so its row is the BF16 engine's
    mismatch against the same trainer log-probabilities, bit for bit (end to end, its
    both-sides row is the all-BF16 trainer's against it); a layer without FP8 linears is no
    candidate; every share is ``(base - error) / (base - 1)``."""
    from nemo_fp8_plugin.registry import get_recipe
    from nemo_fp8_plugin.tools.rl_check_model import RunningSumTask

    template = _template()
    spec = get_recipe("fp8_blockwise")
    a, settings = rl_check.ARM_SPECS[arm], QUICK
    fp8 = {m for m in rl_check.fp8_modules_of(template, spec, 2) if ".layers.0." in m}
    assert fp8 == {f"model.layers.0.{k}" for k in _LINEARS}
    task = RunningSumTask(4)
    prompts = task.prompts(32, torch.Generator().manual_seed(1))
    # as run_seed computes: one thread (two are slow on a loaded CPU), eager quantizers
    with _one_thread(), torch.no_grad(), fused_mode(False):
        trainer = rl_check.Trainer(
            template, 1e-3, fp8_spec=spec if a.fp8_training else None, fp8_modules=fp8
        )
        engine = rl_check._make_engine(template, a, settings, spec, fp8, False)
        rl_check._refit(trainer, engine, spec, 2)
        completions, _ = engine.generate(prompts, 4, torch.Generator().manual_seed(2))
        seq = torch.cat([prompts, completions], dim=1)
        train_lp = trainer.logprobs(seq, task.prompt_len).float()
        rows = rl_check.attribute(
            template, a, settings, spec, trainer, engine, fp8, prompts, completions, train_lp
        )
        bf16 = rl_check._make_engine(
            template, rl_check.ARM_SPECS["bf16"], settings, spec, set(), False
        )
        rl_check._refit(trainer, bf16, spec, 2)
        bf16_lp = bf16.generate(prompts, 4, None, forced=completions)[1]
        bf16_train_lp = rl_check.Trainer(template, 1e-3).logprobs(seq, task.prompt_len).float()
    by = {r["bf16"]: r for r in rows}
    assert set(by) == {"none", "layer.0"} | {k.rpartition(".")[2] for k in _LINEARS}
    assert by["layer.0"]["token_mult_prob_error"] == rl_check._mismatch(train_lp, bf16_lp)
    base = by["none"]["token_mult_prob_error"]
    assert base > 1.0 and base != by["layer.0"]["token_mult_prob_error"]
    for r in rows[1:]:
        assert r["removed"] == pytest.approx((base - r["token_mult_prob_error"]) / (base - 1))
    if a.fp8_training:
        assert by["layer.0"]["both_sides"] == rl_check._mismatch(bf16_train_lp, bf16_lp)
        for r in rows[1:]:
            assert r["both_sides_removed"] == pytest.approx((base - r["both_sides"]) / (base - 1))
    else:
        assert all("both_sides" not in r for r in rows)


# ------------------------------------------------------------------ the engine's pieces


def _template():
    from nemo_fp8_plugin.tools.rl_check_model import TinyLlama

    torch.manual_seed(0)
    return TinyLlama(16, 10, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4)


def test_nemo_rl_engine_quantizes_the_refit_bf16_weights_as_nemo_rl_does():
    from nemo_fp8_plugin.numerics.nemo_rl_numerics import quantize_weight_nemo_rl
    from nemo_fp8_plugin.registry import get_recipe
    from nemo_fp8_plugin.rl import quantize_for_refit
    from nemo_fp8_plugin.tools.rl_check_model import Engine

    template = _template()
    spec = get_recipe("fp8_blockwise")
    modules = rl_check.fp8_modules_of(template, spec, 2)
    trainer = rl_check.Trainer(template, 1e-3)
    with torch.no_grad():  # weights that are not a fresh init's
        for p in trainer.model.parameters():
            p.mul_(1.7).add_(0.01)
    nemo = Engine(template, modules, pow2_scales=False, weight_path="nemo_rl")
    te = Engine(template, modules, pow2_scales=False, weight_path="trainer")
    rl_check._refit(trainer, nemo, spec, 2)
    rl_check._refit(trainer, te, spec, 2)
    bf16 = dict(trainer.state_for_refit())
    refit = dict(quantize_for_refit(list(bf16.items()), spec, num_layers=2))
    differ = 0
    for name, linear in nemo.fp8_linears.items():
        data, scale = quantize_weight_nemo_rl(bf16[name])
        assert torch.equal(linear.weight.view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(linear.weight_scale_inv, scale), name
        other = te.fp8_linears[name]
        assert torch.equal(other.weight.view(torch.uint8), refit[name].view(torch.uint8))
        differ += int((other.weight_scale_inv != linear.weight_scale_inv).sum())
    assert differ > 0  # the two quantizers disagree somewhere: two weight paths, two arms


def test_fp8_kv_engine_quantizes_queries_with_q_scale():
    from nemo_fp8_plugin.tools.rl_check_model import CoreAttention

    attn = CoreAttention(32, "fp8")
    attn.k_scale.fill_(0.01)
    attn.v_scale.fill_(0.02)
    attn.q_scale.fill_(0.013)
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 32).to(torch.bfloat16) for _ in range(3))
    out = attn(q, k, v, {})
    # vLLM: QuantFP8(static, per tensor): fp32(q) * reciprocal(q_scale), clamp, cast
    q8 = (q.float() * torch.tensor(0.013).reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)
    qd = q8.float() * 0.013
    kd = (k.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.01
    vd = (v.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.02
    scores = (qd * (1 / math.sqrt(32))) @ kd.transpose(-1, -2)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert torch.equal(out, (torch.softmax(scores, -1) @ vd).to(torch.bfloat16))
    attn.q_scale.fill_(0.5)  # another q_scale, another result: the scale is used
    assert not torch.equal(attn(q, k, v, {}), out)


def test_forced_tokens_score_what_sampling_reported():
    from nemo_fp8_plugin.tools.rl_check_model import Engine, RunningSumTask

    template = _template()
    task = RunningSumTask(4)
    engine = Engine(template, set(), pow2_scales=False)
    prompts = task.prompts(16, torch.Generator().manual_seed(1))
    tokens, lp = engine.generate(prompts, 4, torch.Generator().manual_seed(2))
    again, lp2 = engine.generate(prompts, 4, None, forced=tokens)
    assert torch.equal(again, tokens) and torch.equal(lp2, lp)


# ------------------------------------------------------------------ the CLI's words


@pytest.mark.slow
def test_the_smoke_run_says_it_is_one(quick):
    assert "SMOKE RUN" in quick["text"]
    assert "| no |" not in quick["text"]  # no "learns: no" verdicts from a smoke run
    assert all(quick["by_arm"][a]["learns"] is None for a in ARMS)


def test_help_says_what_the_code_does(capsys):
    with pytest.raises(SystemExit):
        cli_main(["rl-check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "%%" not in text and "95% interval" in text
    assert f"{QUICK.seeds} seeds, {QUICK.steps} small steps" in text
    assert f"number of seeds (default {rl_check.FULL.seeds})" in text
    assert f"GRPO steps per arm and seed (default {rl_check.FULL.steps})" in text
    for arm in ARMS:
        assert arm in text


# ------------------------------------------------------------------ outputs, as apply -o


def _no_work(*a, **k):
    raise AssertionError("the check started before its outputs were checked")


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_a_read_only_output_is_refused_without_force(monkeypatch, capsys, tmp_path, flag):
    monkeypatch.setattr(rl_check, "run_check", _no_work)
    target = tmp_path / ("out.json" if flag == "--json" else "out.png")
    target.write_text("mine")
    target.chmod(0o444)
    assert cli_main(["rl-check", "--quick", flag, str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "read-only" in err and "--force" in err and "\n" not in err
    assert target.read_text() == "mine"

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(rl_check, "run_check", started)
    with pytest.raises(Started):  # --force: the outputs pass their checks, the work starts
        cli_main(["rl-check", "--quick", "--force", flag, str(target)])


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_a_missing_folder_is_refused_not_created(monkeypatch, capsys, tmp_path, flag):
    monkeypatch.setattr(rl_check, "run_check", _no_work)
    missing = tmp_path / "no" / "such"
    assert cli_main(["rl-check", "--quick", flag, str(missing / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "does not exist" in err and "\n" not in err
    assert not (tmp_path / "no").exists()
    # a link to a file in a missing folder: the same
    link = tmp_path / "link.json"
    link.symlink_to(missing / "out.json")
    assert cli_main(["rl-check", "--quick", flag, str(link)]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()


# ------------------------------------------------------------------ the report's statistics


def test_verdicts_and_their_margins_on_known_intervals():
    def d(mean, se, t=2.0):
        return {"mean": mean, "se": se, "ci95": t * se, "n": 8}

    v = stats.verdict(d(-0.05, 0.005), 0.03)  # interval [-0.06, -0.04]
    assert v["word"] == "below" and v["margin_se"] == pytest.approx(8.0) and v["firm"]
    v = stats.verdict(d(0.0, 0.005), 0.03)  # [-0.01, 0.01]: 0 inside by 2 SE, gap 4 SE away
    assert v["word"] == "within" and v["margin_se"] == pytest.approx(2.0) and v["firm"]
    v = stats.verdict(d(0.012, 0.005), 0.03)  # [0.002, 0.022]: above, 0.4 SE from 0
    assert v["word"] == "above" and v["margin_se"] == pytest.approx(0.4) and not v["firm"]
    v = stats.verdict(d(0.0, 0.02), 0.03)  # [-0.04, 0.04]: past the gap by 0.5 SE only
    assert v["word"] == "unresolved" and v["margin_se"] == pytest.approx(0.5)
    assert stats.verdict(None, 0.03)["word"] == "none"
    assert stats.verdict({"mean": 0.1, "se": math.nan, "ci95": math.nan}, 0.03)["word"] == "none"


def test_the_reference_comparison_is_e2e_is_minus_gen_is_paired():
    base = [0.6, 0.5, 0.7, 0.65]
    gen_is = [b - 0.04 + 0.002 * k for k, b in enumerate(base)]
    e2e_is = [b - 0.001 * k for k, b in enumerate(base)]
    result = _result({"bf16": base, "fp8-gen-is": gen_is, "fp8-e2e-is": e2e_is})
    ref = report.summarize(result)["reference"]
    diffs = [e - g for e, g in zip(e2e_is, gen_is)]
    assert ref["arms"] == ["fp8-gen-is", "fp8-e2e-is"]
    assert ref["difference"] == t_interval(diffs)
    assert ref["paired_sd"] == pytest.approx(statistics.stdev(diffs))
    assert ref["verdict"]["word"] == "above"
    assert ref["power"]["seeds_to_resolve"] == 3  # sd 0.0039: 4.30 * sd / sqrt(3) < 0.03
    text = report.render_tables(result)
    assert "NVIDIA's comparison, fp8-e2e-is - fp8-gen-is" in text and "above" in text
    assert report.summarize(_result({"bf16": base, "fp8-gen": base}))["reference"] is None


def test_power_per_arm_is_printed_beside_each_arm():
    base = [0.6, 0.5, 0.7, 0.65]
    wobble = [0.05, -0.05, 0.04, -0.04]
    result = _result(
        {"bf16": base, "fp8-gen": [b + w for b, w in zip(base, wobble)], "fp8-e2e": base}
    )
    summary = report.summarize(result)
    per_arm = summary["power"]["per_arm"]
    assert per_arm["fp8-e2e"]["paired_sd"] == 0.0
    text = report.render_tables(result, summary)
    row = next(line for line in text.splitlines() if line.startswith("| fp8-gen |"))
    p = per_arm["fp8-gen"]
    assert row.endswith(f"| {p['paired_sd']:.4f} ({p['seeds_to_resolve']}) |")


def test_nightly_checks_of_each_suite_on_known_steps():
    """Each seed is a run checked as NeMo RL's suite of the arm's kind checks it: generation
    only median and share above 1.1; end to end mean and last step; FP8 KV cache median < 2."""
    errors = {
        "bf16": [1.0, 1.0],
        # median 1.05 but 1 of 4 steps above: fails the share rule; seed 1 passes
        "fp8-gen": [[1.0, 1.05, 1.05, 1.2], [1.0, 1.0, 1.0, 1.0]],
        # mean 1.05 passes, last step 1.1 fails; seed 1 passes
        "fp8-e2e": [[1.0, 1.0, 1.1], [1.0, 1.0, 1.05]],
        # median 1.5 passes despite a step at 3.0; seed 1 median 2.5 fails
        "fp8-e2e-is-kv": [[1.0, 1.5, 3.0], [2.5, 2.5, 1.0]],
    }
    arms = report.summarize(_result({a: [0.5, 0.5] for a in errors}, errors))["arms"]
    passing = {a: r["nightly_bound"]["seeds_passing"] for a, r in arms.items()}
    assert passing == {"bf16": 2, "fp8-gen": 1, "fp8-e2e": 1, "fp8-e2e-is-kv": 1}
    assert arms["fp8-gen"]["nightly_bound"]["check"].startswith("median < 1.1 and share")
    assert arms["fp8-e2e"]["nightly_bound"]["check"] == "mean < 1.1 and last step < 1.1"
    assert arms["fp8-e2e-is-kv"]["nightly_bound"]["check"] == "median < 2"
    # the median over all steps and seeds stands beside the mean
    assert arms["fp8-e2e-is-kv"]["token_mult_prob_error_median"] == pytest.approx(2.0)
    assert arms["fp8-gen"]["token_mult_prob_error_median"] == pytest.approx(1.0)


# ------------------------------------------------------------------ the engine and calibration


def test_kv_scales_are_calibrated_on_the_whole_batch():
    """NeMo RL calibrates on every sequence it is given (``grpo.py`` passes the step's whole
    ``train_data``): no cap on the sequences."""
    from nemo_fp8_plugin.tools.rl_check_model import Engine

    template = _template()
    settings = rl_check.with_overrides(QUICK, kv_calibration_micro_batch=64)
    trainer = rl_check.Trainer(template, 1e-3)
    engine = Engine(template, set(), pow2_scales=False, kv_cache_dtype="fp8")
    refresh = rl_check._KVRefresh(trainer, engine, settings)
    seen = []
    trainer.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    refresh(torch.randint(0, 10, (300, 9)))
    assert seen == [64, 64, 64, 64, 44]


def test_a_refit_replaces_the_weights_the_engine_computes_with():
    """The engine keeps its FP8 weights dequantized between refits; a refit (an in-place
    copy) must reach the next generation, exactly as in an engine that never ran."""
    from nemo_fp8_plugin.registry import get_recipe
    from nemo_fp8_plugin.tools.rl_check_model import Engine, RunningSumTask

    template = _template()
    spec = get_recipe("fp8_blockwise")
    modules = rl_check.fp8_modules_of(template, spec, 2)
    trainer = rl_check.Trainer(template, 1e-3)
    used = Engine(template, modules, pow2_scales=False, weight_path="nemo_rl")
    rl_check._refit(trainer, used, spec, 2)
    prompts = RunningSumTask(4).prompts(8, torch.Generator().manual_seed(0))
    first, _ = used.generate(prompts, 4, None)
    _, before = used.generate(prompts, 4, None, forced=first)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.5)
    rl_check._refit(trainer, used, spec, 2)
    fresh = Engine(template, modules, pow2_scales=False, weight_path="nemo_rl")
    rl_check._refit(trainer, fresh, spec, 2)
    tokens, lp = used.generate(prompts, 4, None, forced=first)
    _, lp_fresh = fresh.generate(prompts, 4, None, forced=first)
    assert torch.equal(lp, lp_fresh) and not torch.equal(lp, before)
