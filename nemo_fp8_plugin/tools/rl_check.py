"""``nemo-fp8 rl-check``: end-to-end FP8 RL on a CPU, seven arms, several seeds.

A tiny Llama-shaped causal LM (pure torch) learns a task with a verifiable reward by GRPO:
the running sum mod 10 of the prompt's digits, an answer of 16 tokens each of which follows
from the one before (:class:`.rl_check_model.RunningSumTask`), so a token the FP8 engine picks
differently derails the rest of its answer: mismatch compounds. Reward: share of answer
digits right.
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

After every optimizer step the trainer's weights are *refit* into the engine. In the NeMo RL
arms the trainer sends BF16 weights and the engine quantizes them on arrival as NeMo RL's
vLLM worker does (:func:`nemo_fp8_plugin.numerics.nemo_rl_numerics.quantize_weight_nemo_rl`,
not bit-identical to the trainer's TE quantizer); in ``fp8-e2e-te-refit`` the trainer
quantizes them itself (:func:`nemo_fp8_plugin.rl.quantize_for_refit`: TE's 128x128-tile E4M3
plus ``weight_scale_inv``), so both sides hold the very same FP8 weights. The FP8-KV arm
calibrates per-layer q/k/v scales on the trainer as NeMo RL's GRPO loop does
(``calibrate_qkv_fp8_scales(..., include_q=True)``: before the first generation on the step's
prompts, after every optimizer step on the step's training data, prompts and responses;
:class:`nemo_fp8_plugin.rl.kv_scales.KVScaleCalibrator`, percentile 99.9, margin 1.05) and
ships them with the refit; the engine stores keys and values as ``E4M3(k / k_scale)`` and
quantizes queries with ``q_scale``, as vLLM's FP8 KV cache and FlashAttention do.

The arms (:data:`ARM_SPECS`): ``bf16``; ``fp8-gen`` (FP8 generation, BF16 training);
``fp8-gen-is`` (the same with token-level truncated importance sampling, TIS, ratio 2);
``fp8-e2e`` (FP8 on both sides); ``fp8-e2e-is`` (NVIDIA's recipe: FP8 on both sides plus
TIS); ``fp8-e2e-is-kv`` (plus the FP8 KV cache and FP8 queries); ``fp8-e2e-te-refit``
(``fp8-e2e`` with the trainer-side TE-exact refit instead of NeMo RL's worker-side one).

Each seed gets its own supervised warm-up (RL starts from an instruction-tuned model), and
within a seed every arm starts from the same weights and sees the same prompts and sampling
streams (common random numbers), so arms are compared seed by seed (paired). The
evaluation prompts are held out from every prompt the seed trains on (:class:`PromptSplit`,
checked at the end of every arm). Per step the loop records NeMo RL's mismatch metrics
(:func:`~nemo_fp8_plugin.rl.importance.mismatch_metrics` on the training vs generation
log-probabilities of the sampled tokens), the reward, and the wall time of each phase; at
one step it also attributes the mismatch to layers and module kinds (:func:`attribute`).
The summary, tables, JSON and curves are :mod:`.rl_check_report`'s, the statistics
:mod:`.rl_check_stats`'.

Over 600 lines because it is one experiment read top to bottom: the arms and settings, the
trainer, the refit, the loop and the attribution that reuses the loop's engines and refit.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..capabilities import capability
from ..rl.importance import importance_weights, mismatch_metrics
from .harness import Stopwatch
from .rl_check_bounds import (
    TOKEN_MULT_PROB_ERROR_BOUND,
    TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV,
    bound_for,
)
from .rl_check_model import Engine, PromptSplit, RunningSumTask, TinyLlama, bf16_gemms

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
    "attribute",
    "attribution_index",
    "mismatch_bound",
    "TOKEN_MULT_PROB_ERROR_BOUND",
    "TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV",
    "with_overrides",
    "TinyLlama",
    "RunningSumTask",
]

SEED_THREADS = 1
"""Torch threads each seed runs at, whatever the caller's: with two, some reductions split
their sums differently and the records change (a test checks they do not). The JSON's
``environment`` records it as ``seed_threads`` beside ``seed_processes``."""


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
    """The engine keeps an FP8 KV cache (and quantizes queries) with per-layer q/k/v scales
    refreshed every step."""
    weight_path: str = "nemo_rl"
    """What the refit sends the engine's FP8 layers (:data:`.rl_check_model.WEIGHT_PATHS`):
    ``nemo_rl``, BF16 weights the engine quantizes as NeMo RL's vLLM worker does;
    ``trainer``, FP8 weights quantized on the trainer with TE's numerics."""


ARM_SPECS: dict[str, ArmSpec] = {
    a.name: a
    for a in (
        ArmSpec("bf16", False, False, False, False),
        ArmSpec("fp8-gen", True, False, False, False),
        ArmSpec("fp8-gen-is", True, False, True, False),
        ArmSpec("fp8-e2e", True, True, False, False),
        ArmSpec("fp8-e2e-is", True, True, True, False),
        ArmSpec("fp8-e2e-is-kv", True, True, True, True),
        ArmSpec("fp8-e2e-te-refit", True, True, False, False, weight_path="trainer"),
    )
}
ARMS = tuple(ARM_SPECS)
"""The seven arms, in the order the tables list them."""


def mismatch_bound(arm: str) -> float:
    """NeMo RL's nightly ``token_mult_prob_error`` bound that applies to ``arm``."""
    return bound_for(ARM_SPECS[arm].fp8_kv_cache if arm in ARM_SPECS else False)


@dataclass(frozen=True)
class CheckSettings:
    """Size of the check. :data:`FULL` is the documented run, :data:`QUICK` the CI one."""

    steps: int = 12
    """GRPO steps per arm (one optimizer step each). The arms' trajectories drift apart step
    by step, so the paired SD of final reward grows with the steps; from the warm-up's 0.7,
    12 steps of 256 sequences learn (gain well above 3 SE) short of the task's ceiling, with
    a smaller drift than twice the steps of half the batch (docs/rl.md)."""
    seeds: int = 10
    """Independent repetitions (own warm-up, prompts, sampling); seeds ``seed .. seed+seeds-1``.
    10: 12 minutes on two idle cores (measured, docs/performance.md); even, so two worker
    processes stay busy to the end. Every run's power statement says, from its own paired SDs, how many
    each comparison needs."""
    prompts_per_step: int = 32
    """Distinct prompts per step (32 x 8 samples: a larger batch, a smaller drift)."""
    generations_per_prompt: int = 8
    """Samples per prompt (the GRPO group)."""
    digits: int = 16
    """Digits of the prompt, tokens of the answer (:class:`.rl_check_model.RunningSumTask`):
    long enough for a mismatch to compound, short enough for the CPU."""
    warmup_steps: int = 600
    """Most supervised warm-up steps before RL (shared by the arms of a seed)."""
    warmup_target: float | None = 0.7
    """Greedy reward (on 256 training prompts) at which the warm-up stops: a policy that gets
    most answers right for a while and then slips. From a lower start (0.6) some seeds' RL
    does not learn in the budget. None: always ``warmup_steps`` steps."""
    warmup_check_every: int = 5
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
    eval_prompts: int = 1024
    """Held-out prompts of the greedy evaluation at the start and at the end: distinct, and no
    prompt the seed trains on is one of them (:class:`PromptSplit`). Every arm of a seed is
    evaluated on the same ones, so their own sampling noise mostly cancels in the paired
    differences."""
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
    kv_calibration_micro_batch: int = 64
    """Sequences per calibration forward: each forward gives one amax sample per layer, and the
    percentile runs over them (NeMo RL's ``micro_batch_size``; with a handful of samples the
    99.9th percentile is their max whatever the micro-batch, so a larger one only saves
    time)."""
    seed: int = 0
    """First seed."""
    attribution_step: int | None = -1
    """The step whose mismatch is attributed to layers and module kinds (:func:`attribute`),
    counted from 0, negative from the end; None: no attribution."""
    attribution_seeds: int | None = 2
    """The attribution runs on the first this many seeds (None: all): it costs about ten
    steps per arm. Its intervals (over these seeds) say how far the ranking is resolved."""
    reward_gap: float = 0.03
    """The paired final-reward gap the power statement asks about (NVIDIA's FP8-generation
    vs end-to-end gap, 0.586 vs 0.613, is 0.027)."""
    smoke: bool = False
    """A smoke run (``--quick``): too short to learn; the tables say so instead of "no"."""


FULL = CheckSettings()
QUICK = CheckSettings(
    steps=3,
    seeds=2,
    prompts_per_step=8,
    generations_per_prompt=8,
    digits=8,
    warmup_steps=120,
    warmup_target=None,
    eval_prompts=64,
    attribution_seeds=1,
    smoke=True,
)

LIMITS = {
    "steps": (1, 100_000),
    "seeds": (1, 64),
    # torch seeds each stream with seed*16 + (1 .. 6): keep all of them in its range
    "seed": (0, (2**63 - 1) // 16 - 64),
}
"""Bounds of the command-line numbers (inclusive)."""


# --------------------------------------------------------------------------- the trainer


def policy_model(template: TinyLlama, fp8_spec, fp8_modules) -> TinyLlama:
    """A BF16 copy of ``template`` whose linears named in ``fp8_modules`` run TE's block-FP8
    numerics under ``fp8_spec`` (None: all BF16), the others the BF16 GEMM."""
    model = copy.deepcopy(template).to(torch.bfloat16)
    if fp8_spec is not None:
        from ..numerics import convert_to_fp8_emulation

        convert_to_fp8_emulation(
            model, fp8_spec, module_filter=lambda name, module: name in fp8_modules
        )
    bf16_gemms(model)
    return model


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
        self.model = policy_model(template, fp8_spec, fp8_modules).train()
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
    cpu_seconds: float = 0.0
    """CPU time of the arm (its process, one torch thread: what the arm costs whatever else
    shares the machine; evaluations and attribution included)."""
    warmup_cpu_seconds: float = 0.0
    """CPU time of the seed's warm-up (the same for its arms; counted once per seed)."""
    eval_overlap: int = -1
    """Evaluation prompts that are also training prompts of the seed (checked: 0)."""
    attribution: list[dict[str, Any]] = field(default_factory=list)
    """:func:`attribute` at ``attribution_step`` (FP8-generation arms only)."""

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
    load_average: tuple[float, ...] = ()
    """The machine's 1-minute load average at the start and at the end (how shared it was)."""

    def of(self, arm: str) -> list[SeedArmResult]:
        return [r for r in self.runs if r.arm == arm]


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


def _greedy_reward(model: TinyLlama, task: RunningSumTask, prompts: torch.Tensor) -> float:
    """Greedy reward of ``model`` itself (its own weights, no engine; KV cache)."""
    caches: list[dict] = [{} for _ in model.model.layers]
    with torch.no_grad():
        logp = model(prompts, caches, 0)[:, -1]
        picked = []
        for i in range(task.digits):
            tok = logp.argmax(-1)
            picked.append(tok)
            if i + 1 < task.digits:
                logp = model(tok[:, None], caches, prompts.shape[1] + i)[:, -1]
    return float(task.reward(prompts, torch.stack(picked, 1)).mean())


def _warmup(
    template: TinyLlama, task: RunningSumTask, split: PromptSplit, s: CheckSettings, seed: int
) -> int:
    """Supervised warm-up in FP32 to a partly competent policy (RL starts from an SFT model):
    until the greedy reward on prompts of its own reaches ``s.warmup_target`` (checked every
    ``s.warmup_check_every`` steps) or ``s.warmup_steps`` steps have run. A target rather than
    a step count puts every seed's RL phase at a similar start. Every prompt it sees, its
    checks' included, comes from outside the evaluation set. Returns the steps run."""
    gen = torch.Generator().manual_seed(seed * 16 + 1)
    check = split.train(256, torch.Generator().manual_seed(seed * 16 + 7))
    split.note(check)
    opt = torch.optim.Adam(template.parameters(), lr=s.warmup_lr)
    for step in range(1, s.warmup_steps + 1):
        prompts = split.train(s.warmup_batch, gen)
        split.note(prompts)
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


def _evaluate(engine: Engine, task: RunningSumTask, prompts: torch.Tensor) -> float:
    completions, _ = engine.generate(prompts, task.digits, None)
    return float(task.reward(prompts, completions).mean())


class _KVRefresh:
    """Trainer-side q/k/v scale calibration and its refresh into the engine (FP8-KV arm), as
    NeMo RL's GRPO loop runs ``calibrate_qkv_fp8_scales(data, include_q=True)``: a forward of
    the trainer over ``data`` with the core attentions hooked."""

    def __init__(self, trainer: Trainer, engine: Engine, s: CheckSettings):
        from ..rl.kv_scales import KVScaleCalibrator

        self.trainer, self.engine, self.s = trainer, engine, s
        self.calibrator = KVScaleCalibrator(
            trainer.model, percentile=s.kv_percentile, margin=s.kv_margin, include_q=True
        )
        expected = {
            f"{layer}.attn.{role}_scale" for layer in self.calibrator.layer_names for role in "qkv"
        }
        missing = set(engine.kv_scale_names + engine.q_scale_names) ^ expected
        if missing:  # a naming bug would leave the engine's scales at 1.0 silently
            raise RuntimeError(f"trainer and engine disagree on KV-scale names: {sorted(missing)}")

    def __call__(self, inputs: torch.Tensor) -> tuple[float, float]:
        """Calibrate on the model inputs ``inputs`` (all of them, as NeMo RL calibrates on
        the whole batch it is given) with the trainer's current weights, load the scales into
        the engine; returns (calibration seconds, refresh seconds)."""
        mb = self.s.kv_calibration_micro_batch
        model = self.trainer.model

        def forward() -> None:
            with torch.no_grad():
                for chunk in inputs.split(mb):
                    model(chunk)

        with Stopwatch() as calib:
            update = self.calibrator.calibrate(forward)
        with Stopwatch() as refresh:
            self.engine.load_weights(update.items())
        return calib.seconds, refresh.seconds


def _make_engine(
    template: TinyLlama, a: ArmSpec, s: CheckSettings, spec, fp8_modules: set[str], kv: bool
) -> Engine:
    return Engine(
        template,
        fp8_modules,
        pow2_scales=spec.pow2_scales,
        numerics=s.generation_numerics,
        kv_cache_dtype="fp8" if kv else "auto",
        weight_path=a.weight_path,
    )


def _refit(trainer: Trainer, engine: Engine, spec, num_layers: int) -> tuple[int, float, float]:
    """One refit: (bytes sent, trainer-side quantize seconds, engine load seconds). The
    trainer-side path quantizes every FP8 weight the refit rules pick and sends BF16 for the
    layers the engine keeps in BF16; NeMo RL's path sends BF16 and the engine quantizes."""
    named = trainer.state_for_refit()
    quant_s = 0.0
    if engine.fp8 and engine.weight_path == "trainer":
        from ..rl import quantize_for_refit

        with Stopwatch() as quant:
            # materialized here: the quantizer may be lazy, and its time is the trainer's
            quantized = list(quantize_for_refit(named, spec, num_layers=num_layers))
        quant_s = quant.seconds
        bf16 = dict(named)
        named = []
        for name, tensor in quantized:
            base = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
            if tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
                if base not in engine.fp8_linears:
                    continue  # a layer this engine keeps in BF16 (attribution)
            elif name in engine.fp8_linears:
                raise RuntimeError(f"the refit rules left {name} in BF16; the engine has FP8")
            named.append((name, tensor))
        named += [(n, bf16[n]) for n in _bf16_kept(engine, quantized)]
    with Stopwatch() as load:
        received = engine.load_weights(named)
    return received, quant_s, load.seconds


def _bf16_kept(engine: Engine, quantized: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Weights the refit sent in FP8 whose layer this engine holds in BF16."""
    return [
        name
        for name, tensor in quantized
        if tensor.dtype == torch.float8_e4m3fn and name not in engine.fp8_linears
    ]


def _mismatch(train_lp: torch.Tensor, gen_lp: torch.Tensor) -> float:
    mask = torch.ones_like(train_lp, dtype=torch.bool)
    return mismatch_metrics(train_lp, gen_lp, mask)["token_mult_prob_error"]


def attribution_groups(fp8_modules: set[str], num_layers: int, kv: bool) -> dict[str, set[str]]:
    """The candidates :func:`attribute` keeps in BF16 one at a time: each layer
    (``layer.<i>``: its FP8 linears), each module kind (``q_proj``, ..., ``down_proj``: that
    linear in every layer) and, with an FP8 KV cache, ``kv_cache`` (BF16 keys, values and
    queries)."""
    groups: dict[str, set[str]] = {}
    for i in range(num_layers):
        members = {m for m in fp8_modules if m.startswith(f"model.layers.{i}.")}
        if members:
            groups[f"layer.{i}"] = members
    for kind in sorted({m.rpartition(".")[2] for m in fp8_modules}):
        groups[kind] = {m for m in fp8_modules if m.rpartition(".")[2] == kind}
    if kv:
        groups["kv_cache"] = set()
    return groups


def attribute(
    template: TinyLlama,
    a: ArmSpec,
    s: CheckSettings,
    spec,
    trainer: Trainer,
    engine: Engine,
    fp8_modules: set[str],
    prompts: torch.Tensor,
    completions: torch.Tensor,
    train_lp: torch.Tensor,
) -> list[dict[str, Any]]:
    """Where one step's engine/trainer mismatch comes from.

    For each candidate of :func:`attribution_groups`, a copy of the engine keeps it in BF16
    (the trainer's BF16 weights; everything else as the arm's engine, its refit path and its
    current q/k/v scales included), scores the step's sampled tokens with the KV cache
    (teacher-forced: the computation that sampled them) and gives the
    ``token_mult_prob_error`` against the trainer's log-probabilities of the step, which stay
    as they are: the generation side alone changes. Returns one row per candidate (its name
    ``bf16``, the FP8 linears it keeps in BF16 ``modules``), ranked by
    ``removed``: the share of the arm's excess mismatch (``error - 1``) that keeping the
    candidate in BF16 removes (negative: the mismatch grows). In the end-to-end arms the
    trainer runs the candidate in FP8, so keeping it BF16 on the generation side alone adds a
    mismatch of its own; there each row also has ``both_sides``: the candidate in BF16 on
    the trainer too (a copy of the trainer with the step's weights, its log-probabilities
    recomputed), and the ranking follows ``both_sides_removed``. The first row, ``none``, is
    the arm's own engine rescored; it equals the step's recorded mismatch."""
    kv_names = engine.kv_scale_names + engine.q_scale_names
    scales = [(n, engine.slots[n].detach().clone()) for n in kv_names]

    seq = torch.cat([prompts, completions], dim=1)
    prompt_len = prompts.shape[1]

    def engine_lp(eng: Engine) -> torch.Tensor:
        return eng.generate(prompts, completions.shape[1], None, forced=completions)[1]

    def share(base: float, err: float) -> float:
        return (base - err) / (base - 1.0) if base > 1.0 else 0.0

    base = _mismatch(train_lp, engine_lp(engine))
    both = a.fp8_training
    none: dict[str, Any] = {
        "bf16": "none",
        "modules": [],
        "token_mult_prob_error": base,
        "removed": 0.0,
    }
    if both:
        none |= {"both_sides": base, "both_sides_removed": 0.0}
    rows = [none]
    state = trainer.model.state_dict()
    groups = attribution_groups(fp8_modules, s.num_layers, a.fp8_kv_cache)
    for name, members in groups.items():
        kv = a.fp8_kv_cache and name != "kv_cache"
        variant = _make_engine(template, a, s, spec, fp8_modules - members, kv)
        _refit(trainer, variant, spec, s.num_layers)
        if kv:
            variant.load_weights(scales)
        lp = engine_lp(variant)
        err = _mismatch(train_lp, lp)
        row: dict[str, Any] = {
            "bf16": name,
            "modules": sorted(members),
            "token_mult_prob_error": err,
            "removed": share(base, err),
        }
        if both:
            twin = policy_model(template, spec, fp8_modules - members).eval()
            twin.load_state_dict(state)
            with torch.no_grad():
                picked = twin(seq[:, :-1]).gather(-1, seq[:, 1:, None]).squeeze(-1)
            twin_err = _mismatch(picked[:, prompt_len - 1 :].float(), lp)
            row |= {"both_sides": twin_err, "both_sides_removed": share(base, twin_err)}
        rows.append(row)
    key = "both_sides_removed" if both else "removed"
    rows[1:] = sorted(rows[1:], key=lambda r: -r[key])
    return rows


def attribution_index(s: CheckSettings) -> int | None:
    """The step :func:`attribute` runs at (counted from 0), None for none."""
    if s.attribution_step is None:
        return None
    k = s.attribution_step if s.attribution_step >= 0 else s.steps + s.attribution_step
    return k if 0 <= k < s.steps else None


def run_arm(
    arm: str,
    template: TinyLlama,
    task: RunningSumTask,
    s: CheckSettings,
    spec,
    seed: int,
    tick: Callable[[str], None] | None = None,
    split: PromptSplit | None = None,
    start_cache: dict | None = None,
) -> SeedArmResult:
    """Run one arm of one seed from the warm-started ``template``; ``split`` holds the seed's
    evaluation prompts and its record of training prompts (a new one without warm-up
    records when None); ``start_cache`` (one dict per seed) lets arms with the same start
    engine share its start evaluation."""
    if arm not in ARM_SPECS:
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    a = ARM_SPECS[arm]
    t_arm = time.perf_counter()
    cpu_arm = time.process_time()
    if split is None:
        split = _split(task, s, seed)
    fp8_modules = fp8_modules_of(template, spec, s.num_layers) if a.fp8_generation else set()
    trainer = Trainer(
        template, s.lr, fp8_spec=spec if a.fp8_training else None, fp8_modules=fp8_modules
    )
    engine = _make_engine(template, a, s, spec, fp8_modules, a.fp8_kv_cache)
    kv = _KVRefresh(trainer, engine, s) if a.fp8_kv_cache else None
    # the same streams in every arm of a seed: same prompts, same sampling seeds
    prompt_gen = torch.Generator().manual_seed(seed * 16 + 2)
    sample_gen = torch.Generator().manual_seed(seed * 16 + 3)
    attributed = s.attribution_seeds is None or seed < s.seed + s.attribution_seeds
    attribution_at = attribution_index(s) if a.fp8_generation and attributed else None

    def draw() -> torch.Tensor:
        batch = split.train(s.prompts_per_step, prompt_gen)
        split.note(batch)
        return batch.repeat_interleave(s.generations_per_prompt, dim=0)

    result = SeedArmResult(arm, seed)
    _refit(trainer, engine, spec, s.num_layers)
    prompts = draw()
    first_kv = (0.0, 0.0)
    if kv is not None:
        # NeMo RL: the first scales come from the first step's batch before its generation
        # (prompts only), with the weights of the first refit; the start evaluation uses them
        first_kv = kv(prompts)
    # arms whose start engine is the same (same weights, numerics, refit path; no KV scales)
    # share one start evaluation: it is the same computation on the same prompts
    start_key = (a.fp8_generation, a.weight_path, a.fp8_kv_cache)
    if a.fp8_kv_cache or start_cache is None or start_key not in start_cache:
        result.start_reward = _evaluate(engine, task, split.eval)
        if start_cache is not None and not a.fp8_kv_cache:
            start_cache[start_key] = result.start_reward
    else:
        result.start_reward = start_cache[start_key]
    for step in range(s.steps):
        kv_calib_s, kv_refresh_s = first_kv if step == 0 else (0.0, 0.0)
        attribution_s = 0.0
        with Stopwatch() as step_time:
            if step > 0:
                prompts = draw()
            with Stopwatch() as gen_time:
                completions, gen_lp = engine.generate(prompts, task.digits, sample_gen)
            with Stopwatch() as train_time:
                rewards = task.reward(prompts, completions)
                seq = torch.cat([prompts, completions], dim=1)
                train_lp = trainer.logprobs(seq, task.prompt_len).float()
                if step == attribution_at:
                    with torch.no_grad(), Stopwatch() as attribution_time:
                        result.attribution = attribute(
                            template, a, s, spec, trainer, engine, fp8_modules,
                            prompts, completions, train_lp.detach(),
                        )  # fmt: skip
                    attribution_s = attribution_time.seconds  # not a cost of the step
                metrics, weights = _update(trainer, a, s, rewards, train_lp, gen_lp)
            if kv is not None:
                # NeMo RL: after the optimizer step, on the step's training data
                calib, refresh = kv(seq[:, :-1])
                kv_calib_s, kv_refresh_s = kv_calib_s + calib, kv_refresh_s + refresh
            refit_bytes, quant_s, load_s = _refit(trainer, engine, spec, s.num_layers)
        result.steps.append(
            StepRecord(
                step=step,
                reward=float(rewards.mean()),
                token_mult_prob_error=metrics["token_mult_prob_error"],
                gen_kl_error=metrics["gen_kl_error"],
                max_abs_logprob_diff=metrics["max_abs_logprob_diff"],
                sampling_importance_ratio=float(weights.mean()),
                truncated_fraction=metrics["truncated_fraction"],
                step_s=step_time.seconds - attribution_s + (sum(first_kv) if step == 0 else 0.0),
                generate_s=gen_time.seconds,
                train_s=train_time.seconds - attribution_s,
                quantize_s=quant_s,
                load_s=load_s,
                kv_calibration_s=kv_calib_s,
                kv_refresh_s=kv_refresh_s,
                refit_bytes=refit_bytes,
            )
        )
        if tick is not None:
            tick(f"seed {seed} {arm} reward {rewards.mean():.3f}")
    result.final_reward = _evaluate(engine, task, split.eval)
    result.eval_overlap = split.overlap()
    if result.eval_overlap:
        raise RuntimeError(
            f"seed {seed} {arm}: {result.eval_overlap} evaluation prompts were trained on"
        )
    if kv is not None:
        result.kv_scales = {
            n: float(engine.slots[n]) for n in engine.kv_scale_names + engine.q_scale_names
        }
    result.seconds = time.perf_counter() - t_arm
    result.cpu_seconds = time.process_time() - cpu_arm
    return result


def _update(trainer: Trainer, a: ArmSpec, s: CheckSettings, rewards, train_lp, gen_lp):
    """The GRPO update of one step; returns the mismatch metrics and the loss's weights."""
    groups = rewards.view(s.prompts_per_step, s.generations_per_prompt)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1, 1)
    mask = torch.ones_like(train_lp, dtype=torch.bool)
    truncation = "tis" if a.importance_sampling else None
    metrics = mismatch_metrics(
        train_lp, gen_lp, mask, truncation=truncation, ratio_max=s.is_ratio_max
    )
    weights = (
        importance_weights(
            train_lp, gen_lp, mask, level="token", truncation="tis", ratio_max=s.is_ratio_max
        )
        if a.importance_sampling
        else torch.ones_like(train_lp)
    )
    # One optimizer step per batch: the PPO ratio is 1 and its clipping inactive,
    # so the clipped objective's gradient is -w * A * grad(log pi) per token.
    loss = -(weights * adv * train_lp).sum() / mask.sum()
    trainer.step(loss)
    return metrics, weights


def _split(task: RunningSumTask, s: CheckSettings, seed: int) -> PromptSplit:
    return PromptSplit(task, s.eval_prompts, torch.Generator().manual_seed(seed * 16 + 4))


def _template(s: CheckSettings, seed: int) -> tuple[TinyLlama, RunningSumTask, int, PromptSplit]:
    torch.manual_seed(seed * 16 + 6)
    task = RunningSumTask(s.digits)
    template = TinyLlama(
        RunningSumTask.VOCAB,
        task.prompt_len + task.digits,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
    )
    split = _split(task, s, seed)
    warmup = _warmup(template, task, split, s, seed)
    return template, task, warmup, split


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
    torch.set_num_threads(SEED_THREADS)  # and these GEMMs are too small to share
    try:
        # Eager quantizers: same results as the compiled ones, and for tensors this small
        # torch.compile's start-up (a minute or more on a CPU) would dominate the check.
        with fused_mode(False):
            cpu = time.process_time()
            template, task, warmup, split = _template(s, seed)
            warmup_cpu = time.process_time() - cpu
            starts: dict = {}
            runs = [
                run_arm(arm, template, task, s, spec, seed, tick, split, starts) for arm in arms
            ]
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        run.warmup_steps = warmup
        run.warmup_cpu_seconds = warmup_cpu
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
    if not capability(spec.scaling).is_block:
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
                disable=None,  # no bar when stderr is no terminal: no \r updates in a log
            )
        except ImportError:  # tqdm is optional: no bar then
            bar = None

    def tick(text: str) -> None:
        if bar is not None:
            bar.set_postfix_str(text, refresh=False)
            bar.update(1)

    start = time.perf_counter()
    load_start = _load_average()
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
    return CheckResult(
        settings,
        arms,
        runs,
        seconds=time.perf_counter() - start,
        load_average=(load_start, _load_average()),
    )


def _load_average() -> float:
    import os

    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return float("nan")


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


def with_overrides(s: CheckSettings, **changes) -> CheckSettings:
    """``s`` with the changes that are not None (command-line options left unset)."""
    return replace(s, **{k: v for k, v in changes.items() if v is not None})
