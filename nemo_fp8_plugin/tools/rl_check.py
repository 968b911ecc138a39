"""``nemo-fp8 rl-check``: end-to-end FP8 RL on a CPU, in four arms.

A tiny Llama-shaped causal LM (pure torch) learns a toy task with a verifiable reward
(add each digit to its mirror image mod 10; reward = share of answer digits
right) by GRPO. Like NeMo RL,
the loop has two copies of the policy:

* the **trainer**: BF16 parameters with FP32 master weights and Adam (Megatron's layout),
  computing the training log-probabilities in one full-sequence forward;
* the **generation engine**: a separate model that samples token by token with a KV cache
  (as vLLM does) and reports the log-probability of each sampled token.

After every optimizer step the trainer's weights are *refit* into the engine. In the FP8
arms the trainer quantizes them first (:func:`nemo_fp8_plugin.rl.quantize_for_refit`:
128x128-tile E4M3 weights plus ``weight_scale_inv``, vLLM's block-FP8 checkpoint layout,
half the bytes of BF16) and the engine loads the FP8 weights and scales in place; its
linear layers quantize activations per 1x128 tile and run the scaled GEMM
(:func:`nemo_fp8_plugin.numerics.fp8_gemm`). The four arms:

``bf16``
    BF16 engine, BF16 trainer: the mismatch is only kernel order (incremental decoding
    with a KV cache vs one full forward), like vLLM vs Megatron in BF16.
``fp8-gen``
    FP8 engine, BF16 trainer (generation-only FP8): the engine samples from a quantized
    policy the trainer never sees.
``fp8-e2e``
    FP8 engine and FP8 trainer (:func:`nemo_fp8_plugin.numerics.convert_to_fp8_emulation`
    with the same recipe): both sides quantize the same BF16 weights the same way, so the
    mismatch returns to BF16's level. This is NVIDIA's end-to-end FP8 RL recipe.
``fp8-gen-is``
    ``fp8-gen`` with the token-level importance-sampling correction in the loss
    (:func:`nemo_fp8_plugin.rl.importance_weights`).

Per step the loop records NeMo RL's mismatch metrics (:func:`mismatch_metrics` on the
training vs generation log-probabilities of the sampled tokens), the reward, and the time
of each phase; "refit share" is (quantize + transfer + load) / step time.

Everything is seeded: the arms see the same prompts and start from the same weights (a
short supervised warm-up, as RL starts from an instruction-tuned model).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..rl.importance import importance_weights, mismatch_metrics
from .harness import ArmRecord, Stopwatch
from .rl_check_model import Engine, MirrorSumTask, TinyLlama, bf16_gemms

__all__ = [
    "CheckSettings",
    "FULL",
    "QUICK",
    "ARMS",
    "ArmResult",
    "StepRecord",
    "run_check",
    "run_arm",
    "render_tables",
    "with_overrides",
    "TinyLlama",
    "MirrorSumTask",
]

ARMS = ("bf16", "fp8-gen", "fp8-e2e", "fp8-gen-is")
"""The four arms, in the order the tables list them."""


@dataclass(frozen=True)
class CheckSettings:
    """Size of the check. :data:`FULL` is the documented run, :data:`QUICK` the CI one."""

    steps: int = 60
    """GRPO steps per arm (one optimizer step each)."""
    prompts_per_step: int = 16
    """Distinct prompts per step."""
    generations_per_prompt: int = 8
    """Samples per prompt (the GRPO group)."""
    digits: int = 6
    """Digits to reverse (prompt and answer length)."""
    warmup_steps: int = 240
    """Supervised warm-up steps before RL (shared by the arms): to a held-out reward of about
    0.3, a policy that is right on some digits and unsure on the others."""
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
    eval_prompts: int = 128
    """Held-out prompts for the greedy evaluation that gives the final reward."""
    recipe: str = "fp8_blockwise"
    """Recipe of the FP8 arms (a block recipe: NeMo RL's vLLM path has block FP8)."""
    seed: int = 0
    """Seed of prompts, initialisation and sampling."""
    threads: int = 1
    """torch CPU threads (one: these GEMMs are too small to share, and the CI machine is)."""


FULL = CheckSettings()
QUICK = CheckSettings(steps=10, prompts_per_step=8, generations_per_prompt=8, eval_prompts=64)


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """BF16 model parameters, FP32 master weights and Adam (Megatron's mixed precision); in the
    end-to-end arm the linear layers run through the FP8 emulation."""

    def __init__(
        self, template: TinyLlama, lr: float, fp8_spec=None, fp8_modules: set[str] = frozenset()
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
        out = []
        for name, tensor in self.model.state_dict().items():
            if tensor.is_floating_point():
                out.append((name, tensor.detach()))
        return out


# --------------------------------------------------------------------------- one arm


@dataclass
class StepRecord:
    """One GRPO step of one arm."""

    step: int
    reward: float
    token_mult_prob_error: float
    gen_kl_error: float
    sampling_importance_ratio: float
    step_s: float
    refit_s: float
    refit_bytes: int


@dataclass
class ArmResult(ArmRecord[StepRecord]):
    """What one arm produced: ``name`` is the arm, ``steps`` its :class:`StepRecord` list
    (see :class:`~nemo_fp8_plugin.tools.harness.ArmRecord`)."""

    initial_eval_reward: float = 0.0
    """Greedy reward on the held-out prompts before the first RL step."""
    final_eval_reward: float = 0.0
    """Greedy reward on the held-out prompts after the last RL step."""

    @property
    def refit_share(self) -> float:
        """Refit time over step time, summed over the steps (NaN before any step)."""
        step = sum(self.step_seconds)
        return sum(self.series("refit_s")) / step if step else float("nan")

    def summary(self) -> dict[str, Any]:
        """The arm's row of the summary table (and of ``--json``'s ``summary``)."""
        return {
            "arm": self.name,
            "token_mult_prob_error": self.mean("token_mult_prob_error"),
            "token_mult_prob_error_max": max(
                (r.token_mult_prob_error for r in self.steps), default=float("nan")
            ),
            "gen_kl_error": self.mean("gen_kl_error"),
            "final_reward": self.final_eval_reward,
            "initial_reward": self.initial_eval_reward,
            "train_reward_last": self.tail_mean("reward"),
            "refit_share": self.refit_share,
            "refit_mib": self.steps[-1].refit_bytes / 2**20 if self.steps else 0.0,
        }


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


def _refit(trainer: Trainer, engine: Engine, spec, num_layers: int) -> int:
    """Trainer -> engine weight transfer (quantized on the trainer in the FP8 arms)."""
    named = trainer.state_for_refit()
    if engine.fp8:
        from ..rl import quantize_for_refit

        named = quantize_for_refit(named, spec, num_layers=num_layers)
    return engine.load_weights(named)


def _warmup(template: TinyLlama, task: MirrorSumTask, s: CheckSettings) -> None:
    """Supervised warm-up in FP32 to a partly competent policy (RL starts from an SFT model)."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    opt = torch.optim.Adam(template.parameters(), lr=s.warmup_lr)
    for _ in range(s.warmup_steps):
        prompts = task.prompts(s.warmup_batch, gen)
        seq = torch.cat([prompts, task.answers(prompts)], dim=1)
        logp = template(seq[:, :-1])
        nll = -logp.gather(-1, seq[:, 1:, None]).squeeze(-1)[:, task.prompt_len - 1 :]
        opt.zero_grad()
        nll.mean().backward()
        opt.step()


def _evaluate(engine: Engine, task: MirrorSumTask, prompts: torch.Tensor) -> float:
    completions, _ = engine.generate(prompts, task.digits, None)
    return float(task.reward(prompts, completions).mean())


def run_arm(
    arm: str,
    template: TinyLlama,
    task: MirrorSumTask,
    s: CheckSettings,
    spec,
    progress: Callable[[str], None] | None = None,
) -> ArmResult:
    """Run one arm from the warm-started ``template``."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    fp8_gen = arm != "bf16"
    use_is = arm == "fp8-gen-is"
    fp8_modules = fp8_modules_of(template, spec, s.num_layers) if fp8_gen else set()
    trainer = Trainer(
        template, s.lr, fp8_spec=spec if arm == "fp8-e2e" else None, fp8_modules=fp8_modules
    )
    engine = Engine(template, fp8_modules, pow2_scales=spec.pow2_scales)
    prompt_gen = torch.Generator().manual_seed(s.seed + 2)
    sample_gen = torch.Generator().manual_seed(s.seed + 3)
    eval_prompts = task.prompts(s.eval_prompts, torch.Generator().manual_seed(s.seed + 4))
    is_cfg = spec.importance_sampling

    result = ArmResult(arm)
    refit_bytes = _refit(trainer, engine, spec, s.num_layers)
    result.initial_eval_reward = _evaluate(engine, task, eval_prompts)
    for step in range(s.steps):
        with Stopwatch() as step_time:
            prompts = task.prompts(s.prompts_per_step, prompt_gen).repeat_interleave(
                s.generations_per_prompt, dim=0
            )
            completions, gen_lp = engine.generate(prompts, task.digits, sample_gen)
            rewards = task.reward(prompts, completions)
            groups = rewards.view(s.prompts_per_step, s.generations_per_prompt)
            adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
            adv = adv.reshape(-1, 1)

            seq = torch.cat([prompts, completions], dim=1)
            train_lp = trainer.logprobs(seq, task.prompt_len).float()
            mask = torch.ones_like(train_lp, dtype=torch.bool)
            metrics = mismatch_metrics(train_lp, gen_lp, mask)
            weights = (
                importance_weights(
                    train_lp,
                    gen_lp,
                    mask,
                    level=is_cfg.level,
                    truncation=is_cfg.truncation,
                    ratio_max=is_cfg.ratio_max,
                    ratio_min=is_cfg.ratio_min,
                )
                if use_is
                else torch.ones_like(train_lp)
            )
            # One optimizer step per batch: the PPO ratio is 1 and its clipping is inactive, so
            # the clipped objective's gradient is the policy gradient -A * grad(log pi) per token.
            loss = -(weights * adv * train_lp).sum() / mask.sum()
            trainer.step(loss)

            with Stopwatch() as refit_time:
                refit_bytes = _refit(trainer, engine, spec, s.num_layers)
        result.step_seconds.append(step_time.seconds)
        result.steps.append(
            StepRecord(
                step=step,
                reward=float(rewards.mean()),
                token_mult_prob_error=metrics["token_mult_prob_error"],
                gen_kl_error=metrics["gen_kl_error"],
                sampling_importance_ratio=metrics["sampling_importance_ratio"],
                step_s=step_time.seconds,
                refit_s=refit_time.seconds,
                refit_bytes=refit_bytes,
            )
        )
        if progress is not None:
            progress(
                f"{arm:<11} step {step + 1:>3}/{s.steps}  reward {rewards.mean():.3f}  "
                f"mult_err {metrics['token_mult_prob_error']:.5f}"
            )
    result.final_eval_reward = _evaluate(engine, task, eval_prompts)
    result.completed = True
    return result


def run_check(
    settings: CheckSettings = FULL,
    arms: Iterable[str] = ARMS,
    progress: Callable[[str], None] | None = None,
) -> list[ArmResult]:
    """Warm up once, then run each arm from the same weights; returns one result per arm."""
    from ..registry import get_recipe

    spec = get_recipe(settings.recipe)
    if spec.scaling != "block":
        raise ValueError(
            f"rl-check runs a block recipe (NeMo RL's FP8 generation); "
            f"{settings.recipe} is {spec.scaling}"
        )
    from ..numerics import fused_mode

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, settings.threads))
    try:
        # Eager quantizers: same results as the compiled ones, and for tensors this small
        # torch.compile's start-up (a minute or more on a CPU) would dominate the check.
        with fused_mode(False):
            torch.manual_seed(settings.seed)
            task = MirrorSumTask(settings.digits)
            template = TinyLlama(
                MirrorSumTask.VOCAB,
                task.prompt_len + task.digits,
                hidden_size=settings.hidden_size,
                intermediate_size=settings.intermediate_size,
                num_layers=settings.num_layers,
                num_heads=settings.num_heads,
            )
            _warmup(template, task, settings)
            return [run_arm(arm, template, task, settings, spec, progress) for arm in arms]
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- tables


def render_tables(
    results: list[ArmResult], settings: CheckSettings, every: int | None = None
) -> str:
    """One table per arm (its steps), then the summary table, as Markdown."""
    lines = []
    every = every or max(1, settings.steps // 6)
    for res in results:
        lines.append(f"### arm `{res.name}`\n")
        lines.append("| step | reward | token_mult_prob_error | gen_kl_error | refit share |")
        lines.append("|---:|---:|---:|---:|---:|")
        for r in res.steps:
            if (r.step + 1) % every == 0 or r.step == 0:
                lines.append(
                    f"| {r.step + 1} | {r.reward:.3f} | {r.token_mult_prob_error:.5f} | "
                    f"{r.gen_kl_error:.2e} | {r.refit_s / r.step_s:.1%} |"
                )
        lines.append("")
    lines.append("### summary\n")
    lines.append(
        "| arm | token_mult_prob_error, mean (worst step) | gen_kl_error, mean | final "
        f"reward (greedy, held out; start {results[0].initial_eval_reward if results else 0:.3f}) | refit + refresh, share of step time | "
        "refit payload |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|")
    for res in results:
        s = res.summary()
        lines.append(
            f"| {s['arm']} | {s['token_mult_prob_error']:.5f} "
            f"({s['token_mult_prob_error_max']:.4f}) | {s['gen_kl_error']:.2e} "
            f"| {s['final_reward']:.3f} | {s['refit_share']:.1%} | "
            f"{s['refit_mib']:.2f} MiB |"
        )
    return "\n".join(lines) + "\n"


def with_overrides(s: CheckSettings, **changes) -> CheckSettings:
    """``s`` with the changes that are not None (command-line options left unset)."""
    return replace(s, **{k: v for k, v in changes.items() if v is not None})
