"""What each source line the ignore-list rows of ``stacks.FACTS`` cite must hold, for the
tests that read every release's source (``tests/hosts/test_vllm_ignore.py`` for the wheels,
``tests/hosts/vllm/test_ignore.py`` for the installed vLLM).

Row -> the cited file (its last path component) -> a fragment of the cited line: every
``path:line (release)`` of the row's source names a line holding its file's fragment.
"""

from __future__ import annotations

from vllm_source import citations

CITED = {
    "Fp8Config.get_quant_method:is_layer_skipped": {
        "fp8.py": "def get_quant_method(",
        "quant_utils.py": "def is_layer_skipped(",
    },
    "is_layer_skipped:experts_substring": {"quant_utils.py": 'elif "experts" in prefix'},
    "is_layer_skipped:fused_name_first": {
        "quant_utils.py": "if proj_name in fused_mapping and match_func(prefix, ignored_layers)"
    },
    "ModelOptQuantConfigBase.is_layer_excluded:is_layer_skipped": {
        "modelopt.py": "def is_layer_excluded(self, prefix: str) -> bool:"
    },
    "ModelOptQuantConfigBase.is_layer_excluded:substring": {
        "modelopt.py": "exclude_module in prefix"
    },
    "ModelOptQuantConfigBase.is_layer_excluded:fnmatch": {
        "modelopt.py": "if fnmatch(prefix, wildcard_pattern):"
    },
    "ModelOptQuantConfigBase.apply_vllm_mapper:star_rewrite": {
        "modelopt.py": 'exclude[-1] == "*" and exclude[-2] != "."'
    },
    "ModelOptQuantConfigBase.get_quant_method:lm_head": {
        "modelopt.py": "isinstance(layer, (LinearBase, ParallelLMHead))"
    },
    "hf_to_vllm_mapper:llama": {"llama.py": "hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper"},
    "hf_to_vllm_mapper:qwen3_moe": {
        "qwen3_moe.py": "hf_to_vllm_mapper = Qwen3MoeModel.hf_to_vllm_mapper"
    },
}


def cited_lines(version: str) -> list[tuple[str, str, int, str]]:
    """``(row, file, line, fragment)`` for every line an ignore-list row cites in release
    ``version``; a test reads each line from that release and looks for the fragment."""
    from nemo_fp8_plugin import stacks

    out = []
    for name, fragments in CITED.items():
        row = stacks.fact("vllm", name)
        assert row is not None, name
        for path, first, last, release in citations(row.source):
            if release == version:
                assert first == last, (name, path, first, last)
                out.append((name, path, first, fragments[path.rsplit("/", 1)[-1]]))
    return out


def check_cited_lines(version: str, read) -> None:
    """Every line the ignore-list rows cite in ``version`` holds its fragment (``read(path)``
    gives the release's file), and every row the release has cites it."""
    from nemo_fp8_plugin import stacks

    cites = cited_lines(version)
    for name, path, line, fragment in cites:
        text = read(path).splitlines()[line - 1]
        assert fragment in text, (version, name, f"{path}:{line}", text)
    having = {n for n in CITED if stacks.lookup("vllm", n, version).present}
    assert {n for n, *_ in cites} == having, version
    for name in having:  # each of the row's files is cited in every release that has it
        files = {p.rsplit("/", 1)[-1] for n, p, *_ in cites if n == name}
        assert files == set(CITED[name]), (version, name, files)
