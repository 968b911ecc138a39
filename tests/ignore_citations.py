"""What each source line :data:`nemo_fp8_plugin.hosts.vllm.ignore.RELEASES` cites must hold
(a fragment of that line), for the tests that read every release's source."""

CITED = {
    "is_layer_skipped": "def is_layer_skipped(",
    "fused name first": "if proj_name in fused_mapping and match_func(prefix, ignored_layers)",
    "experts substring": 'elif "experts" in prefix',
    "Fp8Config.get_quant_method": "def get_quant_method(",
    "is_layer_excluded": "def is_layer_excluded(self, prefix: str) -> bool:",
    "modelopt substring": "exclude_module in prefix",
    "modelopt wildcard": "if fnmatch(prefix, wildcard_pattern):",
    "modelopt star rewrite": 'exclude[-1] == "*" and exclude[-2] != "."',
    "modelopt lm_head": "isinstance(layer, (LinearBase, ParallelLMHead))",
}
