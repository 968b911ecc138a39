"""The toy task, the tiny model and the generation engine of ``nemo-fp8 rl-check``.

Kept apart from the RL loop (:mod:`nemo_fp8_plugin.tools.rl_check`): these are the pieces
that stand in for NeMo RL's environment, the policy's architecture and vLLM; the loop, the
trainer and the tables are the check itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "RunningSumTask",
    "PromptSplit",
    "TinyLlama",
    "BF16Linear",
    "bf16_gemms",
    "CoreAttention",
    "FP8EngineLinear",
    "Engine",
    "WEIGHT_PATHS",
]

WEIGHT_PATHS = ("trainer", "nemo_rl")
"""What a refit sends the engine's FP8 layers (:class:`Engine`)."""


# --------------------------------------------------------------------------- the task


class RunningSumTask:
    """Prompt: ``BOS d1 .. dn SEP``; answer digit i: ``(d_1 + ... + d_i) mod 10``, the running
    sum; reward: share of answer digits right (verifiable).

    Each answer digit is the previous answer digit plus one prompt digit, so a model that
    learns the task computes it from its own previous token: one wrong token makes the
    digits after it wrong too. That is how a mismatch compounds over an answer of ``n``
    tokens: a token the FP8 engine picks where the trainer's policy would not changes
    everything the engine generates after it."""

    BOS, SEP = 10, 11
    VOCAB = 16  # 10 digits, BOS, SEP, 4 unused ids

    def __init__(self, digits: int):
        if not 1 <= digits <= 18:  # prompt ids are int64 (10**18 < 2**63)
            raise ValueError(f"digits must be in [1, 18], got {digits}")
        self.digits = digits
        self.prompt_len = digits + 2

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        return self.encode(torch.randint(0, self.space, (n,), generator=gen))

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        return prompts[:, 1 : 1 + self.digits].cumsum(1) % 10

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        return (completions == self.answers(prompts)).float().mean(dim=1)

    @property
    def space(self) -> int:
        """How many distinct prompts there are (``10 ** digits``)."""
        return 10**self.digits

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompts of the integer ids ``[n]`` in ``[0, space)`` (the digits of the id)."""
        powers = 10 ** torch.arange(self.digits - 1, -1, -1, dtype=torch.int64)
        body = (ids[:, None] // powers) % 10
        n = ids.shape[0]
        return torch.cat([torch.full((n, 1), self.BOS), body, torch.full((n, 1), self.SEP)], dim=1)

    def decode(self, prompts: torch.Tensor) -> torch.Tensor:
        """The integer id of each prompt ``[n, prompt_len]`` (inverse of :meth:`encode`)."""
        powers = 10 ** torch.arange(self.digits - 1, -1, -1, dtype=torch.int64)
        return (prompts[:, 1 : 1 + self.digits] * powers).sum(dim=1)


class PromptSplit:
    """A seed's evaluation prompts, held out from every prompt it trains on.

    ``eval_count`` distinct prompts are drawn; :meth:`train` draws training prompts uniformly
    from the others. Whatever trains (warm-up batches and their checks, RL prompts,
    calibration batches) is passed to :meth:`note`, and :meth:`overlap` counts the evaluation
    prompts among them from those records, not from how they were drawn."""

    def __init__(self, task: RunningSumTask, eval_count: int, gen: torch.Generator):
        if not 0 < eval_count < task.space:
            raise ValueError(f"eval_count must be in [1, {task.space - 1}], got {eval_count}")
        self.task = task
        ids = torch.empty(0, dtype=torch.int64)
        while ids.numel() < eval_count:  # distinct ids (at 16 digits a repeat is rare)
            more = torch.randint(0, task.space, (eval_count,), generator=gen)
            ids = torch.unique(torch.cat([ids, more]))
        ids = ids[torch.randperm(ids.numel(), generator=gen)]  # a uniform subset, not the smallest
        self.eval_ids = ids[:eval_count]
        self.eval = task.encode(self.eval_ids)
        self.trained = torch.zeros(eval_count, dtype=torch.bool)
        """Which evaluation prompts were noted as trained on."""

    def train(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` training prompts (with replacement) from outside the evaluation set."""
        ids = torch.randint(0, self.task.space, (n,), generator=gen)
        redraw = torch.isin(ids, self.eval_ids)
        while redraw.any():
            ids[redraw] = torch.randint(0, self.task.space, (int(redraw.sum()),), generator=gen)
            redraw = torch.isin(ids, self.eval_ids)
        return self.task.encode(ids)

    def note(self, prompts: torch.Tensor) -> None:
        """Record prompts (or whole sequences, prompt first) that something trained on."""
        ids = self.task.decode(prompts[:, : self.task.prompt_len])
        self.trained |= torch.isin(self.eval_ids, ids)

    def overlap(self) -> int:
        """Evaluation prompts that also occur among the noted training prompts."""
        return int(self.trained.sum())


# --------------------------------------------------------------------------- the model


class BF16Linear(nn.Linear):
    """``nn.Linear`` whose GEMM runs in fp32 on the (BF16) operands and rounds the output to
    the input dtype: a BF16 GEMM's math (fp32 accumulation, BF16 output) at fp32 speed, since
    CPUs without BF16 instructions run BF16 matmuls an order of magnitude slower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float()).to(x.dtype)


def bf16_gemms(model: nn.Module) -> None:
    """Give every plain ``nn.Linear`` left in ``model`` the fp32-accumulating BF16 GEMM (a class
    swap: parameters, names and state-dict keys stay as they are)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BF16Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class CoreAttention(nn.Module):
    """The attention kernel on ``q, k, v`` ``[batch, heads, seq, head_dim]``: vLLM's
    ``self_attn.attn`` (its ``Attention`` layer, which owns the KV cache and its ``k_scale`` /
    ``v_scale``), megatron-core's ``core_attention``.

    ``nemo_fp8_qkv_layout`` tells :class:`~nemo_fp8_plugin.rl.kv_scales.KVScaleCalibrator` to
    record its first three inputs as q, k, v. With ``kv_cache_dtype="fp8"`` (the engine of
    the FP8-KV arm) new keys and values are stored in the cache as vLLM's FP8 KV cache stores
    them, ``E4M3(sat(k / k_scale))``, and dequantized (``* k_scale``) where attention reads
    them, prefill included (vLLM writes the cache first and attends over it). Queries are
    quantized too, as vLLM 0.32's ``Attention.forward`` does whenever the KV cache is FP8 and
    the backend takes quantized queries (FlashAttention does): ``QuantFP8(static=True,
    PER_TENSOR)`` with ``q_scale``, ``E4M3(clamp(fp32(q) * reciprocal(q_scale)))``, read back
    by the kernel as ``q8 * q_scale`` (its ``q_descale``)."""

    nemo_fp8_qkv_layout = "bhsd"

    def __init__(self, head_dim: int, kv_cache_dtype: str = "auto"):
        super().__init__()
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.head_dim = head_dim
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype == "fp8":
            # vLLM's parameter names: model.layers.<i>.self_attn.attn.{k,v}_scale
            self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
            # model.layers.<i>.self_attn.attn.q_scale (1.0 until calibrated: vLLM's default)
            self.register_buffer("q_scale", torch.ones((), dtype=torch.float32))

    def _to_cache(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.kv_cache_dtype != "fp8":
            return t
        from ..numerics.scaling import saturating_cast

        # vLLM's reshape_and_cache: fp32 x / scale, saturating round-to-nearest-even cast
        return saturating_cast(t.float() / scale, 448.0, torch.float8_e4m3fn)

    def _from_cache(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return t.float() * scale if self.kv_cache_dtype == "fp8" else t.float()

    def _query(self, q: torch.Tensor) -> torch.Tensor:
        """The query as the attention kernel reads it (fp32)."""
        if self.kv_cache_dtype != "fp8":
            return q.float()
        # vLLM's QuantFP8.forward_native, static per-tensor: multiply by the reciprocal
        q8 = (q.float() * self.q_scale.reciprocal()).clamp(-448.0, 448.0)
        return q8.to(torch.float8_e4m3fn).float() * self.q_scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: dict | None = None
    ) -> torch.Tensor:
        t = q.shape[2]
        if cache is None:
            # training kernel: scores in fp32, scaled after the product, BF16 probabilities
            s = k.shape[2]
            allowed = torch.ones(t, s, dtype=torch.bool).tril()
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out = probs.to(v.dtype).float() @ v.float()
            return out.to(v.dtype)
        k_scale = getattr(self, "k_scale", None)
        v_scale = getattr(self, "v_scale", None)
        kc, vc = self._to_cache(k, k_scale), self._to_cache(v, v_scale)
        past = 0
        if "k" in cache:
            past = cache["k"].shape[2]
            kc = torch.cat([cache["k"], kc], dim=2)
            vc = torch.cat([cache["v"], vc], dim=2)
        cache["k"], cache["v"] = kc, vc
        s = kc.shape[2]
        allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=past)
        # generation kernel (KV cache): q pre-scaled, fp32 probabilities; the same math
        # in another order, as vLLM's attention differs from Megatron's
        kf, vf = self._from_cache(kc, k_scale), self._from_cache(vc, v_scale)
        scores = (self._query(q) * (1.0 / math.sqrt(self.head_dim))) @ kf.transpose(-1, -2)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ vf).to(v.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.attn = CoreAttention(self.head_dim)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = self.attn(q, k, v, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, inter)

    def forward(self, x, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, vocab: int, max_len: int, hidden: int, inter: int, layers: int, heads: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(max_len, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, inter) for _ in range(layers))
        self.norm = RMSNorm(hidden)


class TinyLlama(nn.Module):
    """A Llama-shaped causal LM with Hugging Face parameter names (``model.layers.0.self_attn.
    q_proj.weight``, ..., ``lm_head.weight``), so refit and BF16 rules see familiar names.
    Learned positions instead of RoPE keep it small; embeddings and ``lm_head`` stay BF16,
    as in vLLM's and Megatron's FP8 paths."""

    def __init__(
        self,
        vocab: int,
        max_len: int,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
    ):
        super().__init__()
        self.model = _Body(vocab, max_len, hidden_size, intermediate_size, num_layers, num_heads)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(
        self, tokens: torch.Tensor, caches: list | None = None, start: int = 0
    ) -> torch.Tensor:
        """Log-probabilities (fp32) of the next token at every position. ``caches`` (one dict
        per layer) selects the generation path with a KV cache; ``start`` is the position of
        ``tokens[:, 0]``."""
        pos = torch.arange(start, start + tokens.shape[1])
        x = self.model.embed_tokens(tokens) + self.model.embed_positions(pos)[None]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, None if caches is None else caches[i])
        logits = self.lm_head(self.model.norm(x))
        return torch.log_softmax(logits.float(), dim=-1)


# --------------------------------------------------------------------------- the generation engine


class FP8EngineLinear(nn.Module):
    """The engine's block-FP8 linear: float8 ``weight`` [N, K] and fp32 ``weight_scale_inv``
    [ceil(N/128), ceil(K/128)] (vLLM's layout), loaded in place at every refit; activations are
    quantized per 1x128 group at run time as the engine computes it
    (:func:`nemo_fp8_plugin.numerics.vllm_numerics.quantize_activation`, ``numerics``
    ``"vllm"``: ``s = amax / 448``, ``q = x / s``, not the trainer's ``x * (448 / amax)``) and
    the GEMM is the emulated scaled FP8 GEMM."""

    def __init__(
        self, out_features: int, in_features: int, pow2_scales: bool, numerics: str = "vllm"
    ):
        super().__init__()
        tiles = (math.ceil(out_features / 128), math.ceil(in_features / 128))
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
        )
        self.register_buffer("weight_scale_inv", torch.ones(tiles, dtype=torch.float32))
        self.pow2_scales = pow2_scales
        self.numerics = numerics

    def requantize_loaded(self) -> None:
        """After a refit under ``vllm_deepgemm_ue8m0``: requantize the loaded weight to
        power-of-2 block scales in place, as vLLM's DeepGEMM path does after loading."""
        from ..numerics import QTensor
        from ..numerics.vllm_numerics import requantize_ue8m0

        if self.numerics != "vllm_deepgemm_ue8m0":
            return
        q = requantize_ue8m0(QTensor(self.weight, self.weight_scale_inv, "e4m3", (128, 128)))
        self.weight.copy_(q.data)
        self.weight_scale_inv.copy_(q.scale_inv)

    def _weight_fp32(self) -> torch.Tensor:
        """The dequantized weight (``weight * weight_scale_inv`` per tile, fp32), as the
        emulated GEMM computes it; kept until a refit writes the buffers in place (their
        version counters move), so a generation dequantizes it once, not once per token."""
        from ..numerics import QTensor

        key = (self.weight._version, self.weight_scale_inv._version)
        if getattr(self, "_w32_key", None) != key:
            wq = QTensor(self.weight, self.weight_scale_inv, "e4m3", (128, 128))
            self._w32 = wq.dequantize(torch.float32)
            self._w32_key = key
        return self._w32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..numerics.vllm_numerics import quantize_activation

        lead = x.shape[:-1]
        xq = quantize_activation(
            x.reshape(-1, x.shape[-1]), self.numerics, (1, 128), pow2_scales=self.pow2_scales
        )
        # numerics.fp8_gemm's math (fp32 GEMM of the dequantized operands) with the weight's
        # dequantization kept between refits
        out = torch.matmul(xq.dequantize(torch.float32), self._weight_fp32().t())
        return out.to(x.dtype).reshape(*lead, -1)


class Engine:
    """The generation side: a :class:`TinyLlama` copy in BF16 whose linear layers named in
    ``fp8_modules`` are :class:`FP8EngineLinear` (activations quantized with ``numerics``);
    with ``kv_cache_dtype="fp8"`` every attention layer keeps an FP8 KV cache with the
    per-layer ``k_scale`` / ``v_scale`` buffers vLLM names
    ``model.layers.<i>.self_attn.attn.{k,v}_scale`` (and ``q_scale``). Weights and scales arrive
    by name, as a refit sends them.

    ``weight_path`` says what a refit sends for the FP8 layers: ``"trainer"``, float8
    ``weight`` plus ``weight_scale_inv`` quantized on the trainer (the plugin's
    ``quantize_for_refit``, Transformer Engine's numerics, bit-identical to the trainer's FP8
    weights); ``"nemo_rl"``, the BF16 ``weight``, which the engine quantizes itself on load as
    NeMo RL's vLLM worker does
    (:func:`nemo_fp8_plugin.numerics.nemo_rl_numerics.quantize_weight_nemo_rl`)."""

    def __init__(
        self,
        template: TinyLlama,
        fp8_modules: set[str],
        pow2_scales: bool,
        *,
        numerics: str = "vllm",
        kv_cache_dtype: str = "auto",
        weight_path: str = "trainer",
    ):
        if weight_path not in WEIGHT_PATHS:
            raise ValueError(f"weight_path must be one of {WEIGHT_PATHS}, got {weight_path!r}")
        self.weight_path = weight_path
        self.pow2_scales = pow2_scales
        self.model = copy.deepcopy(template).to(torch.bfloat16).eval()
        self.fp8 = bool(fp8_modules)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_linears: dict[str, FP8EngineLinear] = {}
        for name in sorted(fp8_modules):
            parent, _, leaf = name.rpartition(".")
            old = self.model.get_submodule(name)
            new = FP8EngineLinear(old.out_features, old.in_features, pow2_scales, numerics)
            self.model.get_submodule(parent).register_module(leaf, new)
            self.fp8_linears[f"{name}.weight"] = new
        if kv_cache_dtype != "auto":
            for layer in self.model.model.layers:
                old_attn = layer.self_attn.attn
                layer.self_attn.attn = CoreAttention(old_attn.head_dim, kv_cache_dtype)
        bf16_gemms(self.model)
        self.slots = dict(self.model.named_parameters()) | dict(self.model.named_buffers())

    @property
    def kv_scale_names(self) -> list[str]:
        """Names of the engine's KV-cache scale buffers (empty without an FP8 KV cache)."""
        return [n for n in self.slots if n.endswith((".attn.k_scale", ".attn.v_scale"))]

    @property
    def q_scale_names(self) -> list[str]:
        """Names of the engine's query scale buffers (FP8 KV cache only)."""
        return [n for n in self.slots if n.endswith(".attn.q_scale")]

    def _nemo_rl_quantize(self, name: str, tensor: torch.Tensor):
        """NeMo RL's worker-side quantization of a BF16 weight of an FP8 layer, as the
        (name, tensor) pairs its patched ``load_weights`` passes on to vLLM."""
        from ..numerics.nemo_rl_numerics import quantize_weight_nemo_rl

        data, scale_inv = quantize_weight_nemo_rl(tensor, pow2_scales=self.pow2_scales)
        return [(name, data), (f"{name}_scale_inv", scale_inv)]

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the slot of the same name, in place; returns bytes received.
        Under ``weight_path="nemo_rl"`` a BF16 weight of an FP8 layer is first quantized as
        NeMo RL's worker does, into that layer's ``weight`` and ``weight_scale_inv``."""
        received = 0
        loaded = set()
        for sent, payload in named:
            received += payload.numel() * payload.element_size()
            pairs = [(sent, payload)]
            if (
                self.weight_path == "nemo_rl"
                and sent in self.fp8_linears
                and payload.dtype != torch.float8_e4m3fn
            ):
                pairs = self._nemo_rl_quantize(sent, payload)
            for name, tensor in pairs:
                self._copy(name, tensor)
                loaded.add(name)
        for name, linear in self.fp8_linears.items():
            if name in loaded:
                linear.requantize_loaded()
        return received

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        slot = self.slots.get(name)
        if slot is None or slot.shape != tensor.shape or slot.dtype != tensor.dtype:
            raise RuntimeError(
                f"refit sent {name} {tuple(tensor.shape)} {tensor.dtype}; the "
                f"engine expects "
                f"{None if slot is None else (tuple(slot.shape), slot.dtype)}"
            )
        slot.copy_(tensor)

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        gen: torch.Generator | None,
        forced: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample (or, with ``gen=None``, greedily pick) ``new_tokens`` tokens after each prompt
        with a KV cache; returns the tokens and the engine's log-probability of each.
        ``forced`` ``[batch, new_tokens]``: take these tokens instead and score them (the same
        computation as sampling them, so the log-probabilities are those sampling reports)."""
        caches = [{} for _ in self.model.model.layers]
        logp = self.model(prompts, caches, 0)[:, -1]
        tokens, logps = [], []
        pos = prompts.shape[1]
        for i in range(new_tokens):
            if forced is not None:
                tok = forced[:, i]
            elif gen is None:
                tok = logp.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            if i + 1 < new_tokens:
                logp = self.model(tok[:, None], caches, pos)[:, -1]
                pos += 1
        return torch.stack(tokens, 1), torch.stack(logps, 1)
