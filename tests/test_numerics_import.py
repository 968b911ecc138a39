"""numerics runs on a machine that has only torch: no YAML, no omegaconf, no host package."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCKED = ("yaml", "omegaconf", "megatron", "transformer_engine", "vllm", "nemo", "torchao")

CODE = """
import sys
for m in {blocked!r}:
    sys.modules[m] = None
import torch
import nemo_fp8_plugin.numerics as N
from nemo_fp8_plugin.spec import RecipeSpec
spec = RecipeSpec(name="custom_block", scaling="block", fp8_format="e4m3",
                  activation_block=(1, 128), weight_block=(128, 128), gradient_block=(1, 128))
q = N.quantize_blockwise(torch.randn(4, 256), (1, 128))
model = N.convert_to_fp8_emulation(torch.nn.Sequential(torch.nn.Linear(128, 128)), spec)
model(torch.randn(2, 128)).sum().backward()
from nemo_fp8_plugin.rl.refit import quantize_for_refit
out = dict(quantize_for_refit({{"l.weight": torch.randn(128, 128)}}, spec,
                              keep_bf16=lambda n: False, fused=False))
assert out["l.weight"].dtype == torch.float8_e4m3fn
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)))
"""


def test_numerics_needs_only_torch():
    probe = "import json\n" + CODE.format(blocked=BLOCKED)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    roots = {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}
    assert not roots & {"yaml", "omegaconf", "megatron", "transformer_engine", "vllm", "nemo",
                        "torchao"}
