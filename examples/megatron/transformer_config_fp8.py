"""Build megatron-core TransformerConfigs for each FP8 recipe (runs on CPU).

    python examples/megatron/transformer_config_fp8.py

megatron-core's own __post_init__ validates every config; the script prints the FP8 fields
and the environment variable each recipe needs in the training process, and ends with a
verdict: ``transformer_config_fp8: PASS`` when every recipe built a config that carries it,
``FAIL`` (exit 1) naming each that did not.
"""

import sys

from nemo_fp8_plugin import get_recipe, list_recipes
from nemo_fp8_plugin.hosts.megatron import build_transformer_config, transformer_config_fields

MODEL = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, bf16=True)

failures = []
for spec in list_recipes():
    try:
        cfg = build_transformer_config(spec, **MODEL)
    except Exception as err:  # megatron-core's own validation: the verdict names it
        failures.append(f"{spec.name}: {type(err).__name__}: {err}")
        continue
    env = transformer_config_fields(spec).env
    # nvfp4 is megatron-core's FP4 (fp4: e2m1, fp4_recipe: nvfp4), with the FP8 fields off
    fmt, recipe = (
        (("fp4", cfg.fp4), ("fp4_recipe", cfg.fp4_recipe))
        if cfg.fp4
        else (("fp8", cfg.fp8), ("fp8_recipe", cfg.fp8_recipe))
    )
    if not fmt[1] or not recipe[1]:
        failures.append(f"{spec.name}: the config has no {fmt[0]} / {recipe[0]}")
    print(
        f"{spec.name:<15} {fmt[0]}={fmt[1]:<6} {recipe[0]}={recipe[1]:<10} "
        f"bf16 layers={cfg.num_layers_at_start_in_bf16 if cfg.first_last_layers_bf16 else 0}"
        f"+{cfg.num_layers_at_end_in_bf16 if cfg.first_last_layers_bf16 else 0} "
        f"fp8_param={cfg.fp8_param} env={env or '-'}"
    )

# Per-module rules become megatron-core's RecipeConfig (applied by Transformer Engine modules).
spec = get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*.linear_qkv"]}})
quant_recipe = build_transformer_config(spec, **MODEL).quant_recipe
print(type(quant_recipe).__name__, "for", spec.bf16_layers.modules)
if quant_recipe is None:
    failures.append("fp8_blockwise with per-module rules: no quant_recipe")

if failures:
    sys.exit("transformer_config_fp8: FAIL: " + "; ".join(failures))
print(
    f"transformer_config_fp8: PASS: {len(list_recipes())} recipes built and validated by "
    "megatron-core's TransformerConfig, per-module rules as its RecipeConfig"
)
