"""NeMo 2 finetuning with an FP8 recipe, from Python (NeMo-Run).

    python examples/nemo2/finetune_fp8.py --recipe fp8_blockwise --dry-run   # CPU: prints the config
    python examples/nemo2/finetune_fp8.py --recipe fp8_blockwise             # GPU node: runs it

The same as `nemo llm finetune --factory llama32_1b_fp8_blockwise`: the stock recipe, FP8 on
its precision plugin, the scale-refresh callback, and the Transformer Engine variable the
recipe needs in the executor's environment.
"""

import argparse

import nemo_run as run
from nemo.collections import llm

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.hosts.nemo2 import add_fp8_to_recipe
from nemo_fp8_plugin.hosts.te import required_env

parser = argparse.ArgumentParser()
parser.add_argument("--recipe", default="fp8_blockwise")
parser.add_argument("--dry-run", action="store_true")
args = parser.parse_args()

spec = get_recipe(args.recipe)
recipe = add_fp8_to_recipe(llm.llama32_1b.finetune_recipe(num_gpus_per_node=1), spec)
executor = run.LocalExecutor(ntasks_per_node=1, launcher="torchrun", env_vars=required_env(spec))
if args.dry_run:
    print(recipe.trainer.plugins)
    print(recipe.trainer.callbacks[-1])
    print("executor env:", executor.env_vars)
else:
    run.run(recipe, executor=executor)
