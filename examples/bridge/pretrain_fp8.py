"""Megatron-Bridge pretraining with an FP8 recipe (GPU node with Megatron-Bridge installed).

    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 torchrun --nproc-per-node 8 \
        examples/bridge/pretrain_fp8.py --recipe fp8_blockwise

The one line Bridge needs is the `register()` call: after it, `mixed_precision: fp8_blockwise`
resolves in Bridge YAML and on its command line. The callback stops the run at start if
Transformer Engine was imported without the variable the recipe needs. It ends with a verdict,
``pretrain_fp8: PASS`` when pretraining returned, ``FAIL`` (exit 1) with the error otherwise.
"""

import argparse
import sys
import traceback

import nemo_fp8_plugin.hosts.bridge as fp8

fp8.register()
from megatron.bridge.recipes.llama import llama3_8b_pretrain_config
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import pretrain

from nemo_fp8_plugin.hosts.bridge.callback import FP8ScaleRefreshBridgeCallback

parser = argparse.ArgumentParser()
parser.add_argument("--recipe", default="fp8_blockwise")
args = parser.parse_args()

cfg = llama3_8b_pretrain_config()
cfg.mixed_precision = args.recipe  # resolved by Bridge's registry at finalize
try:
    pretrain(cfg, forward_step, callbacks=[FP8ScaleRefreshBridgeCallback(args.recipe)])
except Exception as err:
    traceback.print_exc()
    sys.exit(f"pretrain_fp8: FAIL: {type(err).__name__}: {err}")
print(
    f"pretrain_fp8: PASS: pretrained under {args.recipe} (its Transformer Engine recipe checked at start)"
)
