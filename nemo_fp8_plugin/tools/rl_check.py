"""``nemo-fp8 rl-check``: end-to-end FP8 RL on a CPU, six arms, several seeds.

A tiny Llama-shaped causal LM (pure torch) learns a toy task with a verifiable reward
(add each digit to its mirror image mod 10; reward = share of answer digits right) by GRPO.
Like NeMo RL, the loop has two copies of the policy:

* the **trainer**: BF16 parameters with FP32 master weights and Adam (Megatron's layout),
  computing the training log-probabilities in one full-sequence forward; in the end-to-end
  arms its linear layers run Transformer Engine's block-FP8 numerics
  (:func:`nemo_fp8_plugin.numerics.convert_to_fp8_emulation`);
* the **generation engine**: a separate model that samples token by token with a KV cache
  (as vLLM does) and reports the log-probability of each sampled token. In the FP8 arms its
  linear layers hold vLLM's block-FP8 weights and quantize activations as vLLM does
  (:func:`nemo_fp8_plugin.numerics.vllm_numerics.quantize_activation`, ``s = amax / 448``,
  ``q = x / s``), which is not bit-identical to the trainer's ``q = x * (448 / amax)``: end
  to end, the two sides still disagree a little, as they do on a GPU.

After every optimizer step the trainer's weights are *refit* into the engine: in the FP8 arms
the trainer quantizes them (:func:`nemo_fp8_plugin.rl.quantize_for_refit`: 128x128-tile E4M3
plus ``weight_scale_inv``) and the engine loads them in place. The FP8-KV arm also
calibrates per-layer k/v scales on the trainer after the step
(:class:`nemo_fp8_plugin.rl.kv_scales.KVScaleCalibrator`, NeMo RL's percentile 99.9 and
margin 1.05) and ships them with the refit; the engine stores keys and values as
``E4M3(k / k_scale)`` and dequantizes them in attention, as vLLM's FP8 KV cache does.

The arms (:data:`ARM_SPECS`): ``bf16``; ``fp8-gen`` (FP8 generation, BF16 training);
``fp8-gen-is`` (the same with token-level truncated importance sampling, TIS, ratio 2);
``fp8-e2e`` (FP8 on both sides); ``fp8-e2e-is`` (NVIDIA's recipe: FP8 on both sides plus
TIS); ``fp8-e2e-is-kv`` (plus the FP8 KV cache).

Each seed gets its own supervised warm-up (RL starts from an instruction-tuned model), and
within a seed every arm starts from the same weights and sees the same prompts, so arms can
be compared seed by seed (paired). Per step the loop records NeMo RL's mismatch metrics
(:func:`~nemo_fp8_plugin.rl.importance.mismatch_metrics` on the training vs generation
log-probabilities of the sampled tokens), the reward, and the wall time of each phase.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..rl.importance import importance_weights, mismatch_metrics
from .harness import Stopwatch
from .rl_check_model import Engine, MirrorSumTask, TinyLlama, bf16_gemms

__all__ = [
    "ARMS",
    "ARM_SPECS",
    "ArmSpec",
    "CheckSettings",
    "FULL",
    "QUICK",
    "LIMITS",
    "StepRecord",
    "SeedArmResult",
    "CheckResult",
    "run_check",
    "run_seed",
    "run_arm",
    "summarize",
    "render_tables",
    "to_json",
    "plot_curves",
    "t_interval",
    "with_overrides",
    "TinyLlama",
    "MirrorSumTask",
]


@dataclass(frozen=True)
class ArmSpec:
    """What one arm changes."""

    name: str
    fp8_generation: bool
    """The engine's linear layers run block FP8 (vLLM's numerics)."""
    fp8_training: bool
    """The trainer's linear layers run block FP8 (Transformer Engine's numerics)."""
    importance_sampling: bool
    """Token-level TIS in the loss (weights ``min(exp(train - gen), ratio)``)."""
    fp8_kv_cache: bool
    """The engine keeps an FP8 KV cache with per-layer scales refreshed every step."""


ARM_SPECS: dict[str, ArmSpec] = {
    a.name: a
    for a in (
        ArmSpec("bf16", False, False, False, False),
        ArmSpec("fp8-gen", True, False, False, False),
        ArmSpec("fp8-gen-is", True, False, True, False),
        ArmSpec("fp8-e2e", True, True, False, False),
        ArmSpec("fp8-e2e-is", True, True, True, False),
        ArmSpec("fp8-e2e-is-kv", True, True, True, True),
    )
}
ARMS = tuple(ARM_SPECS)
"""The six arms, in the order the tables list them."""


@dataclass(frozen=True)
class CheckSettings:
    """Size of the check. :data:`FULL` is the documented run, :data:`QUICK` the CI one."""

    steps: int = 80
    """GRPO steps per arm (one optimizer step each)."""
    seeds: int = 5
    """Independent repetitions (own warm-up, prompts, sampling); seeds ``seed .. seed+seeds-1``."""
    prompts_per_step: int = 24
    """Distinct prompts per step."""
    generations_per_prompt: int = 8
    """Samples per prompt (the GRPO group)."""
    digits: int = 4
    """Digits of the prompt and of the answer (4: every seed's BF16 arm learns within the
    budget; with 6 the tiny model's warm-up stalls on some seeds)."""
    warmup_steps: int = 600
    """Most supervised warm-up steps before RL (shared by the arms of a seed)."""
    warmup_target: float | None = 0.35
    """Greedy reward at which the warm-up stops: a policy that is right on some digits and
    unsure of the others. None: always ``warmup_steps`` steps."""
    warmup_check_every: int = 10
    """Warm-up steps between checks of the target."""
    warmup_batch: int = 32
    """Sequences per warm-up step."""
    hidden_size: int = 128
    """Model width: one 128-element tile per activation row, one 128x128 weight tile."""
    intermediate_size: int = 256
    """MLP width (a multiple of 128)."""
    num_layers: int = 2
    """Transformer layers."""
    num_heads: int = 4
    """Attention heads."""
    lr: float = 1e-3
    """Adam learning rate of the RL phase."""
    warmup_lr: float = 3e-3
    """Adam learning rate of the warm-up."""
    eval_prompts: int = 512
    """Held-out prompts of the greedy evaluation at the start and at the end."""
    recipe: str = "fp8_blockwise"
    """Recipe of the FP8 arms (a block recipe: NeMo RL's vLLM path has block FP8)."""
    generation_numerics: str = "vllm"
    """How the engine quantizes activations (:data:`nemo_fp8_plugin.numerics.vllm_numerics.
    NUMERICS`): ``vllm`` as vLLM's ``QuantFP8``; ``trainer`` makes both sides bit-identical."""
    is_ratio_max: float = 2.0
    """TIS truncation of the ``-is`` arms (NeMo RL's ``truncated_importance_sampling_ratio``)."""
    kv_percentile: float = 99.9
    """KV-scale calibration percentile (NeMo RL's default)."""
    kv_margin: float = 1.05
    """KV-scale calibration margin (NeMo RL's default)."""
    kv_calibration_sequences: int = 64
    """Sequences of the step's batch the k/v scales are calibrated on (the first ones; NeMo RL
    calibrates on a representative sample batch, not on all of it)."""
    kv_calibration_micro_batch: int = 16
    """Sequences per calibration forward: each forward gives one amax sample per layer, and the
    percentile runs over them (NeMo RL's ``micro_batch_size``)."""
    seed: int = 0
    """First seed."""
    threads: int = 1
    """torch CPU threads per run (one: these GEMMs are too small to share)."""


FULL = CheckSettings()
QUICK = CheckSettings(
    steps=8,
    seeds=2,
    prompts_per_step=8,
    generations_per_prompt=8,
    warmup_steps=120,
    warmup_target=None,
    eval_prompts=64,
)

LIMITS = {
    "steps": (1, 100_000),
    "seeds": (1, 64),
    # torch seeds each stream with seed*16 + (1 .. 6): keep all of them in its range
    "seed": (0, (2**63 - 1) // 16 - 64),
}
"""Bounds of the command-line numbers (inclusive)."""


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """BF16 model parameters, FP32 master weights and Adam (Megatron's mixed precision); in the
    end-to-end arms the linear layers run through the FP8 emulation (TE's numerics)."""

    def __init__(
        self,
        template: TinyLlama,
        lr: float,
        fp8_spec=None,
        fp8_modules: set[str] | frozenset[str] = frozenset(),
    ):
        self.model = copy.deepcopy(template).to(torch.bfloat16).train()
        if fp8_spec is not None:
            from ..numerics import convert_to_fp8_emulation

            convert_to_fp8_emulation(
                self.model, fp8_spec, module_filter=lambda name, module: name in fp8_modules
            )
        bf16_gemms(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.Adam(self.master, lr=lr, betas=(0.9, 0.99), eps=1e-8)

    def logprobs(self, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Log-probabilities of the answer tokens (all positions after the prompt)."""
        logp = self.model(tokens[:, :-1])
        picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return picked[:, prompt_len - 1 :]

    def step(self, loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        loss.backward()
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)

    def state_for_refit(self) -> list[tuple[str, torch.Tensor]]:
        """(name, BF16 tensor) of every weight the engine holds, as Megatron exports them."""
        return [
            (name, tensor.detach())
            for name, tensor in self.model.state_dict().items()
            if tensor.is_floating_point()
        ]


# --------------------------------------------------------------------------- records


@dataclass
class StepRecord:
    """One GRPO step of one arm and seed. Times are wall seconds of the phase."""

    step: int
    reward: float
    """Mean reward of the step's samples (temperature 1)."""
    token_mult_prob_error: float
    gen_kl_error: float
    max_abs_logprob_diff: float
    sampling_importance_ratio: float
    """Mean weight the loss used (1 without a correction)."""
    truncated_fraction: float
    """Share of tokens whose weight a TIS clamp at the ratio changes (or would change)."""
    step_s: float
    generate_s: float
    train_s: float
    quantize_s: float
    """Trainer-side refit quantization (``quantize_for_refit``)."""
    load_s: float
    """Engine load of the refit weights (copy in place, requantization where the numerics ask)."""
    kv_calibration_s: float
    """KV-scale calibration on the trainer (its forward included)."""
    kv_refresh_s: float
    """Loading the new k/v scales into the engine."""
    refit_bytes: int


@dataclass
class SeedArmResult:
    """One arm of one seed."""

    arm: str
    seed: int
    steps: list[StepRecord] = field(default_factory=list)
    start_reward: float = float("nan")
    """Greedy reward of the arm's engine on the held-out prompts before the first RL step."""
    final_reward: float = float("nan")
    """The same after the last RL step."""
    kv_scales: dict[str, float] = field(default_factory=dict)
    """The k/v scales in the engine at the end (FP8-KV arm only)."""
    seconds: float = 0.0
    """Wall time of the arm (evaluations included)."""
    warmup_steps: int = 0
    """Supervised warm-up steps the seed's starting point took (the same for its arms)."""

    def mean(self, attr: str) -> float:
        values = [getattr(s, attr) for s in self.steps]
        return sum(values) / len(values) if values else float("nan")


@dataclass
class CheckResult:
    """Everything one check produced."""

    settings: CheckSettings
    arms: tuple[str, ...]
    runs: list[SeedArmResult]
    seconds: float = 0.0
    """Wall time of the whole check."""

    def of(self, arm: str) -> list[SeedArmResult]:
        return [r for r in self.runs if r.arm == arm]


# --------------------------------------------------------------------------- statistics

# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
    2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
    2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
    2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile (a table to 30 degrees of freedom, then the Cornish-Fisher
    expansion, within 1e-3 of the exact value)."""
    if df < 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Iterable[float]) -> dict[str, float]:
    """Mean, standard error and the 95% t-interval half-width over ``values`` (seeds).
    One value: ``se`` and ``ci95`` are NaN (no interval from one seed)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "se": float("nan"), "ci95": float("nan"), "n": 0}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "se": float("nan"), "ci95": float("nan"), "n": 1}
    se = statistics.stdev(xs) / math.sqrt(n)
    return {"mean": mean, "se": se, "ci95": t_quantile_975(n - 1) * se, "n": n}


# --------------------------------------------------------------------------- one arm


def fp8_modules_of(template: TinyLlama, spec, num_layers: int) -> set[str]:
    """The modules the refit quantizer puts in FP8 under ``spec`` (its BF16 rules decide); the
    engine and, end to end, the trainer use exactly this set."""
    from ..rl import quantize_for_refit

    named = [(n, t.to(torch.bfloat16)) for n, t in template.state_dict().items()]
    return {
        name[: -len(".weight_scale_inv")]
        for name, _ in quantize_for_refit(named, spec, num_layers=num_layers)
        if name.endswith(".weight_scale_inv")
    }


def _greedy_reward(model: TinyLlama, task: MirrorSumTask, prompts: torch.Tensor) -> float:
    """Greedy reward of ``model`` itself (full-sequence forwards, no engine)."""
    seq = prompts
    with torch.no_grad():
        for _ in range(task.digits):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return float(task.reward(prompts, seq[:, task.prompt_len :]).mean())


def _warmup(template: TinyLlama, task: MirrorSumTask, s: CheckSettings, seed: int) -> int:
    """Supervised warm-up in FP32 to a partly competent policy (RL starts from an SFT model):
    until the greedy reward on prompts of its own reaches ``s.warmup_target`` (checked every
    ``s.warmup_check_every`` steps) or ``s.warmup_steps`` steps have run. A target rather than
    a step count puts every seed's RL phase at a similar start. Returns the steps run."""
    gen = torch.Generator().manual_seed(seed * 16 + 1)
    check = task.prompts(256, torch.Generator().manual_seed(seed * 16 + 7))
    opt = torch.optim.Adam(template.parameters(), lr=s.warmup_lr)
    for step in range(1, s.warmup_steps + 1):
        prompts = task.prompts(s.warmup_batch, gen)
        seq = torch.cat([prompts, task.answers(prompts)], dim=1)
        logp = template(seq[:, :-1])
        nll = -logp.gather(-1, seq[:, 1:, None]).squeeze(-1)[:, task.prompt_len - 1 :]
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
        if s.warmup_target is not None and step % s.warmup_check_every == 0:
            if _greedy_reward(template, task, check) >= s.warmup_target:
                return step
    return s.warmup_steps


def _evaluate(engine: Engine, task: MirrorSumTask, prompts: torch.Tensor) -> float:
    completions, _ = engine.generate(prompts, task.digits, None)
    return float(task.reward(prompts, completions).mean())


class _KVRefresh:
    """Trainer-side k/v scale calibration and its refresh into the engine (FP8-KV arm)."""

    def __init__(self, trainer: Trainer, engine: Engine, s: CheckSettings):
        from ..rl.kv_scales import KVScaleCalibrator

        self.trainer, self.engine, self.s = trainer, engine, s
        self.calibrator = KVScaleCalibrator(
            trainer.model, percentile=s.kv_percentile, margin=s.kv_margin, include_q=False
        )
        missing = set(engine.kv_scale_names) ^ {
            f"{layer}.attn.{role}_scale" for layer in self.calibrator.layer_names for role in "kv"
        }
        if missing:  # a naming bug would leave the engine's scales at 1.0 silently
            raise RuntimeError(f"trainer and engine disagree on KV-scale names: {sorted(missing)}")

    def __call__(self, sequences: torch.Tensor) -> tuple[float, float]:
        """Calibrate on ``sequences`` with the trainer's current weights, load the scales
        into the engine; returns (calibration seconds, refresh seconds)."""
        mb = self.s.kv_calibration_micro_batch
        model = self.trainer.model

        sequences = sequences[: self.s.kv_calibration_sequences]

        def forward() -> None:
            for chunk in sequences.split(mb):
                model(chunk[:, :-1])

        with Stopwatch() as calib:
            update = self.calibrator.calibrate(forward)
        with Stopwatch() as refresh:
            self.engine.load_weights(update.items())
        return calib.seconds, refresh.seconds


def run_arm(
    arm: str,
    template: TinyLlama,
    task: MirrorSumTask,
    s: CheckSettings,
    spec,
    seed: int,
    tick: Callable[[str], None] | None = None,
) -> SeedArmResult:
    """Run one arm of one seed from the warm-started ``template``."""
    if arm not in ARM_SPECS:
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    a = ARM_SPECS[arm]
    t_arm = time.perf_counter()
    fp8_modules = fp8_modules_of(template, spec, s.num_layers) if a.fp8_generation else set()
    trainer = Trainer(
        template, s.lr, fp8_spec=spec if a.fp8_training else None, fp8_modules=fp8_modules
    )
    engine = Engine(
        template,
        fp8_modules,
        pow2_scales=spec.pow2_scales,
        numerics=s.generation_numerics,
        kv_cache_dtype="fp8" if a.fp8_kv_cache else "auto",
    )
    kv = _KVRefresh(trainer, engine, s) if a.fp8_kv_cache else None
    # the same streams in every arm of a seed: same prompts, same sampling seeds
    prompt_gen = torch.Generator().manual_seed(seed * 16 + 2)
    sample_gen = torch.Generator().manual_seed(seed * 16 + 3)
    eval_prompts = task.prompts(s.eval_prompts, torch.Generator().manual_seed(seed * 16 + 4))
    calib_prompts = task.prompts(
        s.prompts_per_step * s.generations_per_prompt,
        torch.Generator().manual_seed(seed * 16 + 5),
    )

    def refit() -> tuple[int, float, float]:
        named = trainer.state_for_refit()
        quant_s = 0.0
        if engine.fp8:
            from ..rl import quantize_for_refit

            with Stopwatch() as quant:
                # materialized here: the quantizer may be lazy, and its time is the trainer's
                named = list(quantize_for_refit(named, spec, num_layers=s.num_layers))
            quant_s = quant.seconds
        with Stopwatch() as load:
            received = engine.load_weights(named)
        return received, quant_s, load.seconds

    result = SeedArmResult(arm, seed)
    refit()
    if kv is not None:  # initial scales: the warm-up's kind of data
        kv(torch.cat([calib_prompts, task.answers(calib_prompts)], dim=1))
    result.start_reward = _evaluate(engine, task, eval_prompts)
    for step in range(s.steps):
        kv_calib_s = kv_refresh_s = 0.0
        with Stopwatch() as step_time:
            with Stopwatch() as gen_time:
                prompts = task.prompts(s.prompts_per_step, prompt_gen).repeat_interleave(
                    s.generations_per_prompt, dim=0
                )
                completions, gen_lp = engine.generate(prompts, task.digits, sample_gen)
            with Stopwatch() as train_time:
                rewards = task.reward(prompts, completions)
                groups = rewards.view(s.prompts_per_step, s.generations_per_prompt)
                adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
                adv = adv.reshape(-1, 1)
                seq = torch.cat([prompts, completions], dim=1)
                train_lp = trainer.logprobs(seq, task.prompt_len).float()
                mask = torch.ones_like(train_lp, dtype=torch.bool)
                truncation = "tis" if a.importance_sampling else None
                metrics = mismatch_metrics(
                    train_lp, gen_lp, mask, truncation=truncation, ratio_max=s.is_ratio_max
                )
                weights = (
                    importance_weights(
                        train_lp,
                        gen_lp,
                        mask,
                        level="token",
                        truncation="tis",
                        ratio_max=s.is_ratio_max,
                    )
                    if a.importance_sampling
                    else torch.ones_like(train_lp)
                )
                # One optimizer step per batch: the PPO ratio is 1 and its clipping inactive,
                # so the clipped objective's gradient is -w * A * grad(log pi) per token.
                loss = -(weights * adv * train_lp).sum() / mask.sum()
                trainer.step(loss)
            if kv is not None:
                kv_calib_s, kv_refresh_s = kv(seq)
            refit_bytes, quant_s, load_s = refit()
        result.steps.append(
            StepRecord(
                step=step,
                reward=float(rewards.mean()),
                token_mult_prob_error=metrics["token_mult_prob_error"],
                gen_kl_error=metrics["gen_kl_error"],
                max_abs_logprob_diff=metrics["max_abs_logprob_diff"],
                sampling_importance_ratio=float(weights.mean()),
                truncated_fraction=metrics["truncated_fraction"],
                step_s=step_time.seconds,
                generate_s=gen_time.seconds,
                train_s=train_time.seconds,
                quantize_s=quant_s,
                load_s=load_s,
                kv_calibration_s=kv_calib_s,
                kv_refresh_s=kv_refresh_s,
                refit_bytes=refit_bytes,
            )
        )
        if tick is not None:
            tick(f"seed {seed} {arm} reward {rewards.mean():.3f}")
    result.final_reward = _evaluate(engine, task, eval_prompts)
    if kv is not None:
        result.kv_scales = {n: float(engine.slots[n]) for n in engine.kv_scale_names}
    result.seconds = time.perf_counter() - t_arm
    return result


def _template(s: CheckSettings, seed: int) -> tuple[TinyLlama, MirrorSumTask, int]:
    torch.manual_seed(seed * 16 + 6)
    task = MirrorSumTask(s.digits)
    template = TinyLlama(
        MirrorSumTask.VOCAB,
        task.prompt_len + task.digits,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
    )
    warmup = _warmup(template, task, s, seed)
    return template, task, warmup


def run_seed(
    s: CheckSettings,
    seed: int,
    arms: Iterable[str] = ARMS,
    tick: Callable[[str], None] | None = None,
) -> list[SeedArmResult]:
    """Warm up once for ``seed``, then run each arm from the same weights."""
    from ..numerics import fused_mode
    from ..registry import get_recipe

    spec = get_recipe(s.recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, s.threads))
    try:
        # Eager quantizers: same results as the compiled ones, and for tensors this small
        # torch.compile's start-up (a minute or more on a CPU) would dominate the check.
        with fused_mode(False):
            template, task, warmup = _template(s, seed)
            runs = [run_arm(arm, template, task, s, spec, seed, tick) for arm in arms]
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        run.warmup_steps = warmup
    return runs


def _seed_job(settings: CheckSettings, seed: int, arms: tuple[str, ...], queue) -> list:
    """One seed in a worker process; progress goes back through ``queue``."""
    tick = None if queue is None else queue.put
    return run_seed(settings, seed, arms, tick)


def run_check(
    settings: CheckSettings = FULL,
    arms: Iterable[str] = ARMS,
    progress: bool = False,
    jobs: int = 1,
) -> CheckResult:
    """Every seed, every arm; ``progress`` shows a tqdm bar on stderr. ``jobs > 1`` runs
    seeds in that many worker processes (each seed is seeded on its own, so the records are
    the same; the timings are not, since the workers share the machine)."""
    from ..registry import get_recipe

    arms = tuple(arms)
    spec = get_recipe(settings.recipe)
    if spec.scaling != "block":
        raise ValueError(
            f"rl-check runs a block recipe (NeMo RL's FP8 generation); "
            f"{settings.recipe} is {spec.scaling}"
        )
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(
                total=settings.seeds * len(arms) * settings.steps,
                desc="rl-check",
                unit="step",
                dynamic_ncols=True,
            )
        except ImportError:  # tqdm is optional: no bar then
            bar = None

    def tick(text: str) -> None:
        if bar is not None:
            bar.set_postfix_str(text, refresh=False)
            bar.update(1)

    start = time.perf_counter()
    seeds = [settings.seed + k for k in range(settings.seeds)]
    runs: list[SeedArmResult] = []
    try:
        if jobs <= 1 or len(seeds) == 1:
            for seed in seeds:
                runs += run_seed(settings, seed, arms, tick)
        else:
            runs = _run_parallel(settings, seeds, arms, min(jobs, len(seeds)), tick)
    finally:
        if bar is not None:
            bar.close()
    return CheckResult(settings, arms, runs, seconds=time.perf_counter() - start)


def _run_parallel(settings, seeds, arms, jobs, tick) -> list[SeedArmResult]:
    import multiprocessing
    import os

    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    # the workers import torch before any code of ours runs: silence there what the CLI
    # silences here (torch.cuda's warning about NeMo's pynvml)
    saved = os.environ.get("PYTHONWARNINGS")
    quiet = "ignore:The pynvml package is deprecated:FutureWarning"
    os.environ["PYTHONWARNINGS"] = f"{saved},{quiet}" if saved else quiet
    try:
        return _pool(ctx, settings, seeds, arms, jobs, tick)
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved


def _pool(ctx, settings, seeds, arms, jobs, tick) -> list[SeedArmResult]:
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor, wait

    with ctx.Manager() as manager:
        q = manager.Queue()
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_seed_job, settings, seed, arms, q) for seed in seeds]
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.2)
                while True:
                    try:
                        tick(q.get_nowait())
                    except queue_mod.Empty:
                        break
            runs: list[SeedArmResult] = []
            for f in futures:
                runs += f.result()
    return runs


# --------------------------------------------------------------------------- summary

_COSTS = ("generate_s", "train_s", "quantize_s", "load_s", "kv_calibration_s", "kv_refresh_s")


def summarize(result: CheckResult) -> dict[str, Any]:
    """Per arm: final and start reward (mean, 95% t-interval over seeds), the paired change
    against the start and against ``bf16``, mismatch means and worst step, cost shares."""
    arms: dict[str, Any] = {}
    base = {r.seed: r for r in result.of("bf16")}
    for arm in result.arms:
        runs = result.of(arm)
        steps = [st for r in runs for st in r.steps]
        step_total = sum(st.step_s for st in steps)
        row: dict[str, Any] = {
            "arm": arm,
            "seeds": [r.seed for r in runs],
            "final_reward": t_interval(r.final_reward for r in runs),
            "start_reward": t_interval(r.start_reward for r in runs),
            "gain": t_interval(r.final_reward - r.start_reward for r in runs),
            "train_reward_first": t_interval(_head(r, "reward") for r in runs),
            "train_reward_last": t_interval(_tail(r, "reward") for r in runs),
            "token_mult_prob_error": t_interval(r.mean("token_mult_prob_error") for r in runs),
            "token_mult_prob_error_max": max(
                (st.token_mult_prob_error for st in steps), default=float("nan")
            ),
            "gen_kl_error": t_interval(r.mean("gen_kl_error") for r in runs),
            "truncated_fraction": t_interval(r.mean("truncated_fraction") for r in runs),
            "step_s": step_total / len(steps) if steps else float("nan"),
            "shares": {
                c[:-2]: (sum(getattr(st, c) for st in steps) / step_total if step_total else 0.0)
                for c in _COSTS
            },
            "refit_mib": runs[0].steps[-1].refit_bytes / 2**20 if runs and runs[0].steps else 0.0,
        }
        paired = [(r.final_reward - base[r.seed].final_reward) for r in runs if r.seed in base]
        row["final_vs_bf16"] = t_interval(paired) if arm != "bf16" and paired else None
        gain = row["gain"]
        row["learns"] = bool(gain["n"] >= 2 and gain["mean"] >= 3 * gain["se"] > 0)
        kv = [r.kv_scales for r in runs if r.kv_scales]
        row["kv_scales_last"] = kv[0] if kv else {}
        arms[arm] = row
    return {"arms": arms, "seconds": result.seconds}


def _head(r: SeedArmResult, attr: str, frac: float = 0.1) -> float:
    values = [getattr(s, attr) for s in r.steps]
    k = max(1, int(len(values) * frac))
    return sum(values[:k]) / k if values else float("nan")


def _tail(r: SeedArmResult, attr: str, frac: float = 0.1) -> float:
    values = [getattr(s, attr) for s in r.steps]
    k = max(1, int(len(values) * frac))
    return sum(values[-k:]) / k if values else float("nan")


def _ci(x: dict[str, float] | None, fmt: str = ".3f") -> str:
    if x is None:
        return "-"
    if math.isnan(x["ci95"]):
        return f"{x['mean']:{fmt}}"
    return f"{x['mean']:{fmt}} ± {x['ci95']:{fmt}}"


def render_tables(result: CheckResult, summary: dict[str, Any] | None = None) -> str:
    """The summary tables, as Markdown."""
    summary = summary or summarize(result)
    s = result.settings
    n = s.seeds
    lines = [
        f"rl-check: {len(result.arms)} arms x {n} seed(s) x {s.steps} GRPO steps "
        f"({s.prompts_per_step} prompts x {s.generations_per_prompt} samples), "
        f"recipe {s.recipe}, generation numerics {s.generation_numerics}; "
        f"{result.seconds:.0f} s wall",
        "",
        f"Reward: greedy, {s.eval_prompts} held-out prompts, by the arm's engine; mean ± 95% "
        f"t-interval over {n} seed(s). Δ vs bf16: paired by seed.",
        "",
        "| arm | start | final | gain (final - start) | final - bf16 final | learns (gain >= 3 SE) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for arm in result.arms:
        r = summary["arms"][arm]
        lines.append(
            f"| {arm} | {_ci(r['start_reward'])} | {_ci(r['final_reward'])} | {_ci(r['gain'])} "
            f"| {_ci(r['final_vs_bf16'])} | {'yes' if r['learns'] else 'no'} |"
        )
    lines += [
        "",
        "Mismatch on the sampled tokens (mean over steps, then mean ± 95% t-interval over seeds).",
        "",
        "| arm | token_mult_prob_error | worst step | gen_kl_error | TIS-clamped tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm in result.arms:
        r = summary["arms"][arm]
        lines.append(
            f"| {arm} | {_ci(r['token_mult_prob_error'], '.5f')} | "
            f"{r['token_mult_prob_error_max']:.4f} | {_ci(r['gen_kl_error'], '.2e')} | "
            f"{_ci(r['truncated_fraction'], '.2%')} |"
        )
    lines += [
        "",
        "Measured cost of each phase, share of the step's wall time (all steps and seeds).",
        "",
        "| arm | step (s) | generate | train | trainer quantize | engine load | "
        "KV calibration | KV refresh | refit payload |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in result.arms:
        r = summary["arms"][arm]
        sh = r["shares"]
        pct = {k: (f"{v:.2%}" if v else "-") for k, v in sh.items()}
        lines.append(
            f"| {arm} | {r['step_s']:.3f} | {pct['generate']} | {pct['train']} | "
            f"{pct['quantize']} | {pct['load']} | {pct['kv_calibration']} | "
            f"{pct['kv_refresh']} | {r['refit_mib']:.2f} MiB |"
        )
    return "\n".join(lines) + "\n"


def to_json(result: CheckResult, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` document (without the environment, which the CLI adds)."""
    return {
        "settings": asdict(result.settings),
        "arms": list(result.arms),
        "summary": summary or summarize(result),
        "runs": [
            {
                "arm": r.arm,
                "seed": r.seed,
                "start_reward": r.start_reward,
                "final_reward": r.final_reward,
                "seconds": r.seconds,
                "warmup_steps": r.warmup_steps,
                "kv_scales": r.kv_scales,
                "steps": [asdict(st) for st in r.steps],
            }
            for r in result.runs
        ],
    }


# --------------------------------------------------------------------------- picture


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_curves(result: CheckResult, path, window: int | None = None):
    """Three panels, one line per arm (mean over seeds), written atomically to ``path`` as PNG:
    the training reward (moving average over ``window`` steps, band: 95% t-interval over seeds);
    the same minus the ``bf16`` arm's, paired by seed (band likewise); and
    ``token_mult_prob_error - 1`` per step on a log scale (band: lowest to highest seed)."""
    from .harness import pyplot, write_png

    plt = pyplot()
    s = result.settings
    window = window or max(1, s.steps // 12)
    fig, (ax_r, ax_d, ax_m) = plt.subplots(1, 3, figsize=(13, 3.8), dpi=72)
    colors = plt.get_cmap("tab10")
    base = {r.seed: [st.reward for st in r.steps] for r in result.of("bf16")}

    def band(ax, x, curves, color, label, spread):
        mean = [sum(col) / len(col) for col in zip(*curves)]
        ax.plot(x, mean, color=color, label=label, lw=1.3)
        if len(curves) < 2:
            return
        if spread == "ci":
            stats = [t_interval(col) for col in zip(*curves)]
            lo = [c["mean"] - c["ci95"] for c in stats]
            hi = [c["mean"] + c["ci95"] for c in stats]
        else:
            lo = [min(col) for col in zip(*curves)]
            hi = [max(col) for col in zip(*curves)]
        ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)

    for i, arm in enumerate(result.arms):
        runs = result.of(arm)
        if not runs or not runs[0].steps:
            continue
        x = [st.step + 1 for st in runs[0].steps]
        rewards = [[st.reward for st in r.steps] for r in runs]
        band(ax_r, x, [_smooth(c, window) for c in rewards], colors(i), arm, "ci")
        if arm != "bf16" and base:
            diffs = [
                _smooth([a - b for a, b in zip(c, base[r.seed])], window)
                for c, r in zip(rewards, runs)
                if r.seed in base
            ]
            if diffs:
                band(ax_d, x, diffs, colors(i), arm, "ci")
        mult = [[max(st.token_mult_prob_error - 1.0, 1e-7) for st in r.steps] for r in runs]
        band(ax_m, x, mult, colors(i), arm, "range")
    ax_r.set_title(f"training reward ({window}-step moving average)", fontsize=10)
    ax_d.set_title("training reward minus bf16's, paired by seed", fontsize=10)
    ax_d.axhline(0.0, color="0.5", lw=0.8)
    ax_m.set_title("token_mult_prob_error - 1 (band: seed range)", fontsize=10)
    ax_m.set_yscale("log")
    for ax in (ax_r, ax_d, ax_m):
        ax.set_xlabel("GRPO step")
    ax_r.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"nemo-fp8 rl-check: {len(result.arms)} arms, mean over {s.seeds} seed(s); "
        "reward bands: 95% t-interval over seeds",
        fontsize=10,
    )
    fig.tight_layout()
    return write_png(path, fig)


def with_overrides(s: CheckSettings, **changes) -> CheckSettings:
    """``s`` with the changes that are not None (command-line options left unset)."""
    return replace(s, **{k: v for k, v in changes.items() if v is not None})
