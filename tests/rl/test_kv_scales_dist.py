"""KV-scale amaxes merged across ranks (two gloo processes).

Kept apart from test_kv_scales.py so the spawned children import only torch and the plugin
(spawn re-imports the test module; fork would inherit a process group another test made)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_fp8_plugin.rl.kv_scales import _max_across_ranks


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mine = {
            "model.layers.0.self_attn.k_scale": 1.0 + rank,  # both ranks: max wins
            f"model.layers.{rank + 1}.self_attn.v_scale": 3.0,
        }  # one rank each (PP stages)
        merged = _max_across_ranks(mine, None)
        (out_dir / f"{rank}.json").write_text(json.dumps(merged))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_amax_is_merged_across_ranks_by_max(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, tmp_path), nprocs=2, join=True)
    want = {
        "model.layers.0.self_attn.k_scale": 2.0,
        "model.layers.1.self_attn.v_scale": 3.0,
        "model.layers.2.self_attn.v_scale": 3.0,
    }
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == want
