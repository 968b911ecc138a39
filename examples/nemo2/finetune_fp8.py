"""NeMo 2 finetuning with an FP8 recipe, from Python (NeMo-Run).

    python examples/nemo2/finetune_fp8.py --recipe fp8_blockwise --dry-run   # CPU: prints the config
    python examples/nemo2/finetune_fp8.py --recipe fp8_blockwise             # GPU node: runs it

The same as `nemo llm finetune --factory llama32_1b_fp8_blockwise`: the stock recipe, FP8 on
its precision plugin, the scale-refresh callback, and the Transformer Engine variable the
recipe needs in the executor's environment. It ends with a verdict, ``finetune_fp8: PASS`` or
``FAIL`` (exit 1): with ``--dry-run``, whether the configuration carries the recipe; else
whether NeMo-Run's job succeeded.
"""

import argparse
import sys

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
    plugin, callback = recipe.trainer.plugins, recipe.trainer.callbacks[-1]
    print(plugin)
    print(callback)
    print("executor env:", executor.env_vars)
    precision = plugin.fp4 if spec.scaling == "nvfp4" else plugin.fp8
    failures = [
        *([] if precision else [f"the precision plugin is not {spec.name}'s"]),
        *([] if callback.recipe == spec.name else ["no scale-refresh callback for the recipe"]),
        *[
            f"executor env lacks {k}={v}"
            for k, v in required_env(spec).items()
            if executor.env_vars.get(k) != v
        ],
    ]
    if failures:
        sys.exit(f"finetune_fp8: FAIL: {'; '.join(failures)}")
    print(
        f"finetune_fp8: PASS (dry run): {spec.name} on the precision plugin, its callback, env set"
    )
else:
    with run.Experiment(f"finetune_{spec.name}", executor=executor) as exp:
        exp.add(recipe, name="finetune")
        exp.run(detach=False)  # waits for the job
    state = getattr(exp.jobs[0].state, "name", str(exp.jobs[0].state))
    if state != "SUCCEEDED":
        sys.exit(f"finetune_fp8: FAIL: NeMo-Run's job ended {state}: its log is above")
    print(f"finetune_fp8: PASS: finetuned under {spec.name}")
