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

__all__ = ["MirrorSumTask", "TinyLlama", "BF16Linear", "bf16_gemms", "FP8EngineLinear", "Engine"]


# --------------------------------------------------------------------------- the task


class MirrorSumTask:
    """Prompt: ``BOS d1 .. dn SEP``; answer digit i: ``(d_i + d_(n+1-i)) mod 10``; reward: share
    of answer digits right. Each answer digit needs two prompt positions and the addition
    table, which a tiny model learns gradually: the policy stays stochastic through the run,
    so the generation/training mismatch has probability mass to act on."""

    BOS, SEP = 10, 11
    VOCAB = 16  # 10 digits, BOS, SEP, 4 unused ids

    def __init__(self, digits: int):
        self.digits = digits
        self.prompt_len = digits + 2

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        body = torch.randint(0, 10, (n, self.digits), generator=gen)
        bos = torch.full((n, 1), self.BOS)
        sep = torch.full((n, 1), self.SEP)
        return torch.cat([bos, body, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        body = prompts[:, 1 : 1 + self.digits]
        return (body + body.flip(1)) % 10

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        return (completions == self.answers(prompts)).float().mean(dim=1)


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


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        past = 0
        if cache is not None:
            if "k" in cache:
                past = cache["k"].shape[2]
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        s = k.shape[2]
        allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=past)
        if cache is None:
            # training kernel: scores in fp32, scaled after the product, BF16 probabilities
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out = probs.to(v.dtype).float() @ v.float()
        else:
            # generation kernel (KV cache): q pre-scaled, fp32 probabilities; the same math
            # in another order, as vLLM's attention differs from Megatron's
            scores = (q.float() * (1.0 / math.sqrt(self.head_dim))) @ k.float().transpose(-1, -2)
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out = probs @ v.float()
        out = out.to(v.dtype).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


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
    quantized per 1x128 tile at run time and the GEMM is the emulated scaled FP8 GEMM."""

    def __init__(self, out_features: int, in_features: int, pow2_scales: bool):
        super().__init__()
        tiles = (math.ceil(out_features / 128), math.ceil(in_features / 128))
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
        )
        self.register_buffer("weight_scale_inv", torch.ones(tiles, dtype=torch.float32))
        self.pow2_scales = pow2_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..numerics import QTensor, fp8_gemm, quantize_blockwise

        lead = x.shape[:-1]
        xq = quantize_blockwise(x.reshape(-1, x.shape[-1]), (1, 128), "e4m3", self.pow2_scales)
        wq = QTensor(self.weight, self.weight_scale_inv, "e4m3", (128, 128))
        return fp8_gemm(xq, wq, out_dtype=x.dtype).reshape(*lead, -1)


class Engine:
    """The generation side: a :class:`TinyLlama` copy in BF16 whose linear layers named in
    ``fp8_modules`` are :class:`FP8EngineLinear`. Weights arrive by name, as a refit sends
    them."""

    def __init__(self, template: TinyLlama, fp8_modules: set[str], pow2_scales: bool):
        self.model = copy.deepcopy(template).to(torch.bfloat16).eval()
        self.fp8 = bool(fp8_modules)
        for name in sorted(fp8_modules):
            parent, _, leaf = name.rpartition(".")
            old = self.model.get_submodule(name)
            self.model.get_submodule(parent).register_module(
                leaf, FP8EngineLinear(old.out_features, old.in_features, pow2_scales)
            )
        bf16_gemms(self.model)
        self.slots = dict(self.model.named_parameters()) | dict(self.model.named_buffers())

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the slot of the same name, in place; returns bytes received."""
        received = 0
        for name, tensor in named:
            slot = self.slots.get(name)
            if slot is None or slot.shape != tensor.shape or slot.dtype != tensor.dtype:
                raise RuntimeError(
                    f"refit sent {name} {tuple(tensor.shape)} {tensor.dtype}; the "
                    f"engine expects "
                    f"{None if slot is None else (tuple(slot.shape), slot.dtype)}"
                )
            slot.copy_(tensor)
            received += tensor.numel() * tensor.element_size()
        return received

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        gen: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample (or, with ``gen=None``, greedily pick) ``new_tokens`` tokens after each prompt
        with a KV cache; returns the tokens and the engine's log-probability of each."""
        caches = [{} for _ in self.model.model.layers]
        logp = self.model(prompts, caches, 0)[:, -1]
        tokens, logps = [], []
        pos = prompts.shape[1]
        for i in range(new_tokens):
            if gen is None:
                tok = logp.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            if i + 1 < new_tokens:
                logp = self.model(tok[:, None], caches, pos)[:, -1]
                pos += 1
        return torch.stack(tokens, 1), torch.stack(logps, 1)
