"""The capability table itself: every row, every predicate, every gate, and
that the spec's refusals read the row (change a row and the spec follows), checked against
Transformer Engine 2.20.2's own recipe module where TE states the fact. GPU names as
``nvidia-smi`` prints them.

The torch-side check of the format maxima (``torch.finfo``) is
``tests/numerics/test_formats.py``: this module stays torch-free.
"""

from __future__ import annotations

import dataclasses

import pytest

from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin import capabilities as caps
from nemo_fp8_plugin.capabilities import (
    ARCHS,
    CAPABILITIES,
    FORMAT_MAX,
    FP8_MAX,
    SCALING_KINDS,
    TILE_KEYS,
    VLLM_SCHEMES,
    RecipeCapability,
    amax_epsilon_problem,
    arch_by_name,
    arch_of_capability,
    capability,
    hardware_problems,
)
from nemo_fp8_plugin.registry import list_recipes

pytestmark = pytest.mark.torch_free

PREDICATES = ("is_delayed", "is_current", "is_block", "is_mx", "is_nvfp4")
# The kind each predicate names, as TE's Recipe methods of the same meaning.
PREDICATE_KIND = dict(zip(PREDICATES, ("delayed", "tensorwise", "block", "mx", "nvfp4")))
TE_PREDICATE = dict(
    zip(PREDICATES, ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4"))
)

ROWS = list(CAPABILITIES.items())


# --------------------------------------------------------------------------- the rows


def test_one_row_per_scaling_kind_in_order():
    assert tuple(CAPABILITIES) == SCALING_KINDS
    for kind, row in ROWS:
        assert row.scaling == kind
        assert capability(kind) is row
    with pytest.raises(KeyError):
        capability("fp8")


def test_rows_are_built_by_keyword_only():
    """A row built from positional arguments would silently shift a field; it is a TypeError."""
    row = CAPABILITIES["block"]
    with pytest.raises(TypeError):
        RecipeCapability("block", "Float8BlockScaling", "blockwise")  # type: ignore[misc]
    with pytest.raises(TypeError):
        caps.Arch("hopper", ((9, 0),), ("h100",))  # type: ignore[misc]
    rebuilt = RecipeCapability(
        **{f.name: getattr(row, f.name) for f in dataclasses.fields(RecipeCapability)}
    )
    assert rebuilt == row


@pytest.mark.parametrize("kind,row", ROWS, ids=[k for k, _ in ROWS])
def test_exactly_one_kind_predicate_per_row(kind, row):
    true = [p for p in PREDICATES if getattr(row, p)]
    assert true == [next(p for p, k in PREDICATE_KIND.items() if k == kind)]
    assert row.per_tensor != row.tiled
    assert row.per_tensor == (row.is_delayed or row.is_current)


@pytest.mark.parametrize("kind,row", ROWS, ids=[k for k, _ in ROWS])
def test_tiles_of_each_row(kind, row):
    for key, default, allowed in zip(TILE_KEYS, row.tiles, row.allowed_tiles):
        assert row.default_tile(key) == default and row.allowed(key) == allowed
        if row.per_tensor:
            assert default is None and allowed == frozenset()
        else:
            assert default in allowed
    # The GEMM's inner dimension is tiled by the activation tile's length.
    assert row.block == (None if row.per_tensor else row.tiles[0][1])
    if row.tiled:
        # Token alignment covers at least one tile along K for every tiled kind.
        assert row.dim_align % row.tiles[0][1] == 0 or row.tiles[0][1] % row.dim_align == 0
    # Only NVFP4 has its tiles pinned by a TE variable, so a host that builds TE's recipe
    # without tile arguments (megatron-core) gets the row's defaults elsewhere.
    assert row.argless_tiles == (None if row.per_tensor or row.is_nvfp4 else row.tiles)


def test_allowed_tiles_stated():
    assert capability("block").allowed("weight_block") == {(1, 128), (128, 128)}
    assert capability("mx").allowed("weight_block") == {(1, 32), (32, 32)}
    assert capability("mx").allowed("activation_block") == {(1, 32)}
    assert capability("nvfp4").allowed("weight_block") == {(16, 16), (1, 16)}
    assert capability("nvfp4").argless_tiles is None
    assert capability("mx").argless_tiles == ((1, 32), (1, 32), (1, 32))


@pytest.mark.parametrize("kind,row", ROWS, ids=[k for k, _ in ROWS])
def test_formats_and_maxima_of_each_row(kind, row):
    assert row.element_format in row.fp8_formats or row.element_format == "e4m3"
    assert row.element_max == FORMAT_MAX[row.element_format]
    if row.is_nvfp4:
        assert (row.fp8_formats, row.element_max, row.scale_format) == (("e2m1",), 6.0, "e4m3")
    else:
        assert row.fp8_formats == ("e4m3", "hybrid") and row.element_max == 448.0
    assert row.fixed_pow2 == {"e8m0": True, "e4m3": False, "fp32": None}[row.scale_format]


def test_format_maxima_from_the_bit_layouts():
    """E4M3 (bias 7, no inf: 1.75 * 2**8), E5M2 (bias 15: 1.75 * 2**15), E2M1 (bias 1: 1.5 * 2**2),
    E8M0 (bias 127, byte 0xFE)."""
    assert FP8_MAX == {"e4m3": 1.75 * 2**8, "e5m2": 1.75 * 2**15}
    assert FORMAT_MAX == {**FP8_MAX, "e2m1": 1.5 * 2**2, "e8m0": 2.0 ** (0xFE - 127)}


def test_generation_gates():
    assert VLLM_SCHEMES == ("block", "mx")
    for kind, row in ROWS:
        # A vLLM path has kernels somewhere, and NeMo RL generates only through it.
        assert bool(row.generation_archs) == row.vllm_generation, kind
        assert row.nemo_rl_generation <= row.vllm_generation, kind
        assert row.deepgemm_generation <= row.vllm_generation, kind
        # A kind refused outright has no vLLM path at all.
        assert not (row.generation_refusal and row.vllm_generation), kind
        assert row.generation_archs <= set(caps.ARCH_NAMES)
        assert row.training_archs <= set(caps.ARCH_NAMES)
    assert [k for k, r in ROWS if r.deepgemm_generation] == ["block"]
    assert [k for k, r in ROWS if r.generation_refusal] == ["nvfp4"]
    assert [k for k, r in ROWS if r.history] == ["delayed"]
    assert [k for k, r in ROWS if r.megatron_field == "fp4_recipe"] == ["nvfp4"]


# --------------------------------------------------------------------------- TE's facts


@pytest.fixture(scope="module")
def te(te_recipe_module):
    return te_recipe_module


@pytest.mark.host
@pytest.mark.parametrize("kind,row", ROWS, ids=[k for k, _ in ROWS])
def test_row_agrees_with_transformer_engine(te, kind, row):
    cls = getattr(te, row.te_class)
    obj = cls()
    # TE's own kind predicates (Recipe.delayed(), .mxfp8(), ...) agree with the row's.
    for pred, te_pred in TE_PREDICATE.items():
        assert getattr(obj, te_pred)() == getattr(row, pred), (kind, pred)
    # Only QParams-carrying recipes (current and block scaling) take an amax epsilon.
    has_eps = hasattr(getattr(cls, "fp8_quant_fwd_inp", None), "amax_epsilon")
    assert has_eps == row.te_amax_epsilon
    assert hasattr(obj, "amax_history_len") == row.history
    # Element formats: TE's Format maxima are the table's.
    for fmt in row.fp8_formats:
        member = getattr(te.Format, fmt.upper())
        assert member.value.max_fwd == FORMAT_MAX["e2m1" if fmt == "e2m1" else "e4m3"]
    assert te.Format.HYBRID.value.max_bwd == FP8_MAX["e5m2"]
    # FP8 attention: where TE refuses fp8_dpa at construction, the row says no. (NVFP4 accepts
    # the flag but "is not applying quantization to attention for now": the row says no too.)
    try:
        cls(fp8_dpa=True)
        te_refuses = False
    except Exception:
        te_refuses = True
    if te_refuses:
        assert not row.fp8_attention
    elif not row.is_nvfp4:
        assert row.fp8_attention


@pytest.mark.host
def test_default_tiles_are_te_defaults(te):
    block = te.Float8BlockScaling()
    dim = {1: (1, 128), 2: (128, 128)}
    assert (
        dim[block.x_block_scaling_dim],
        dim[block.w_block_scaling_dim],
        dim[block.grad_block_scaling_dim],
    ) == CAPABILITIES["block"].tiles
    assert te.MXFP8BlockScaling().enable_2d_quantization is False  # 1x32 weights
    assert CAPABILITIES["mx"].tiles[1] == (1, 32)
    nv = te.NVFP4BlockScaling(disable_2d_quantization=False)
    assert nv.disable_2d_quantization is False and CAPABILITIES["nvfp4"].tiles[1] == (16, 16)


# --------------------------------------------------------------------------- the spec reads the row


def _with_row(monkeypatch, kind, **changes):
    monkeypatch.setitem(CAPABILITIES, kind, dataclasses.replace(CAPABILITIES[kind], **changes))


def test_fp8_attention_refusal_reads_the_row(monkeypatch):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_blockwise", "fp8_dot_product_attention": True})
    assert err.value.key == "fp8_dot_product_attention"
    assert "Float8BlockScaling" in str(err.value)
    _with_row(monkeypatch, "block", fp8_attention=True)
    spec = get_recipe({"recipe": "fp8_blockwise", "fp8_dot_product_attention": True})
    assert spec.fp8_dot_product_attention


def test_pow2_rule_reads_the_scale_format(monkeypatch):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "pow2_scales": False})
    assert err.value.key == "pow2_scales"
    _with_row(monkeypatch, "mx", scale_format="fp32")
    assert get_recipe({"recipe": "mxfp8", "pow2_scales": False}).pow2_scales is False


def test_generation_refusal_reads_the_row(monkeypatch):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "nvfp4", "generation": "fp8"})
    assert err.value.key == "generation" and caps.NVFP4_GENERATION_REFUSAL in str(err.value)
    _with_row(monkeypatch, "block", generation_refusal="a reason from the table")
    with pytest.raises(FP8ConfigError, match="a reason from the table") as err:
        get_recipe("fp8_blockwise").replace(kv_cache="auto")  # built anew: validated
    assert err.value.key == "generation"


def test_edge_layer_refusal_reads_the_row(monkeypatch):
    rules = {"bf16_layers": {"first": 1}}
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_delayed", **rules})
    assert err.value.key == "bf16_layers.first"
    _with_row(monkeypatch, "delayed", bf16_edge_layers=True)
    assert get_recipe({"recipe": "fp8_delayed", **rules}).bf16_layers.first == 1
    _with_row(monkeypatch, "tensorwise", bf16_edge_layers=False)
    with pytest.raises(FP8ConfigError, match="tensorwise"):
        get_recipe({"recipe": "fp8_current", **rules})


def test_deepgemm_numerics_read_the_row(monkeypatch):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "generation_numerics": "vllm_deepgemm_ue8m0"})
    assert err.value.key == "generation_numerics"
    _with_row(monkeypatch, "mx", deepgemm_generation=True)
    get_recipe({"recipe": "mxfp8", "generation_numerics": "vllm_deepgemm_ue8m0"})


def test_tiles_read_the_row(monkeypatch):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "weight_block": [1, 16]})
    assert err.value.key == "weight_block" and "allowed: [1, 32], [32, 32]" in err.value.hint
    row = CAPABILITIES["mx"]
    wider = (row.allowed_tiles[0], row.allowed_tiles[1] | {(1, 16)}, row.allowed_tiles[2])
    _with_row(monkeypatch, "mx", allowed_tiles=wider)
    assert get_recipe({"recipe": "mxfp8", "weight_block": [1, 16]}).weight_block == (1, 16)


def test_two_2d_tiles_refused_for_every_tiled_kind():
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_blockwise", "activation_block": [128, 128]})
    assert err.value.key == "weight_block" and "128x128" in str(err.value)


def test_element_formats_read_the_row():
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "nvfp4", "fp8_format": "e4m3"})
    assert (err.value.key, err.value.hint) == ("fp8_format", "use e2m1")
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_current", "fp8_format": "e2m1"})
    assert err.value.key == "fp8_format" and "nvfp4" in str(err.value)


# --------------------------------------------------------------------------- amax epsilon


def test_amax_epsilon_problem_is_the_one_rule():
    assert amax_epsilon_problem("mx", 0.0) is None
    assert "MXFP8BlockScaling" in amax_epsilon_problem("mx", 1e-6)
    for kind in ("delayed", "tensorwise", "block", "nvfp4"):
        assert amax_epsilon_problem(kind, 1e-6) is None, kind
    assert [k for k, r in ROWS if not r.amax_floor] == ["mx"]


def test_spec_refuses_mxfp8_with_amax_epsilon(monkeypatch):
    """MXFP8 + amax_epsilon used to be refused in three places (the vLLM spelling, the vLLM
    method's config, TE's build) and accepted by the spec, so `apply --host megatron` wrote a
    recipe that the training callback then refused: now the spec refuses it, from the row."""
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "amax_epsilon": 1e-6})
    assert err.value.key == "amax_epsilon" and "MXFP8BlockScaling" in str(err.value)
    assert get_recipe({"recipe": "mxfp8", "amax_epsilon": 0.0}).amax_epsilon == 0.0
    assert get_recipe({"recipe": "fp8_blockwise", "amax_epsilon": 1e-6}).amax_epsilon == 1e-6
    _with_row(monkeypatch, "mx", amax_floor=True)
    assert get_recipe({"recipe": "mxfp8", "amax_epsilon": 1e-6}).amax_epsilon == 1e-6


# --------------------------------------------------------------------------- hardware gates


@pytest.mark.parametrize("name", [s.name for s in list_recipes()])
@pytest.mark.parametrize("arch", caps.ARCH_NAMES)
def test_hardware_gates_follow_the_rows(name, arch):
    """A recipe's training is refused exactly where its row's training_archs lack the GPU (or
    for fp32 block scales on Blackwell), its vLLM generation where generation_archs do."""
    spec = get_recipe(name)
    row = capability(spec.scaling)
    problems = [p for p in hardware_problems(spec, arch) if p.level == "error"]
    training_refused = any(p.side in ("training", None) for p in problems)
    trains = arch in row.training_archs and not (
        row.is_block and arch == "blackwell" and not spec.pow2_scales
    )
    assert training_refused == (spec.training == "fp8" and not trains), problems
    generation_refused = any(p.side in ("generation", None) for p in problems)
    generates = not row.vllm_generation or arch in row.generation_archs
    if spec.generation == "fp8" and not training_refused:
        assert generation_refused == (not generates), problems


def test_a_row_change_moves_the_hardware_gate(monkeypatch):
    spec = get_recipe("mxfp8")
    assert any(p.level == "error" for p in hardware_problems(spec, "hopper"))
    _with_row(
        monkeypatch,
        "mx",
        training_archs=frozenset({"hopper", "blackwell"}),
        generation_archs=frozenset({"hopper", "blackwell"}),
    )
    assert not [p for p in hardware_problems(spec, "hopper") if p.level == "error"]


# --------------------------------------------------------------------------- GPU names

NVIDIA_SMI = {
    # GeForce, as nvidia-smi prints them: the "GeForce" word used to defeat the name lookup.
    "NVIDIA GeForce RTX 5090": "blackwell_sm120",
    "NVIDIA GeForce RTX 5080": "blackwell_sm120",
    "NVIDIA GeForce RTX 5070 Ti": "blackwell_sm120",
    "NVIDIA GeForce RTX 5060": "blackwell_sm120",
    "NVIDIA GeForce RTX 4090": "ada",
    "NVIDIA GeForce RTX 4090 D": "ada",
    "NVIDIA GeForce RTX 4070 Ti SUPER": "ada",
    "NVIDIA GeForce RTX 4060": "ada",
    "NVIDIA GeForce RTX 3090": "ampere",
    # Data-center and workstation Ada.
    "NVIDIA L20": "ada",
    "NVIDIA L4": "ada",
    "NVIDIA L40S": "ada",
    "NVIDIA RTX 5000 Ada Generation": "ada",
    "NVIDIA RTX 4500 Ada Generation": "ada",
    "NVIDIA RTX 4000 SFF Ada Generation": "ada",
    "NVIDIA RTX 2000 Ada Generation": "ada",
    "RTX 5000 Ada": "ada",
    # Workstation Blackwell (SM 12.0) and DGX Spark (SM 12.1).
    "NVIDIA RTX PRO 4500 Blackwell": "blackwell_sm120",
    "NVIDIA RTX PRO 5000 Blackwell": "blackwell_sm120",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": "blackwell_sm120",
    "NVIDIA RTX PRO 2000 Blackwell": "blackwell_sm120",
    "NVIDIA GB10": "blackwell_sm120",
    "NVIDIA RTX A6000": "ampere",
    # Data-center names with sizes and form factors.
    "NVIDIA H100 PCIe": "hopper",
    "NVIDIA H100 NVL": "hopper",
    "NVIDIA H200 NVL": "hopper",
    "NVIDIA GH200 480GB": "hopper",
    "NVIDIA H20": "hopper",
    "NVIDIA B200": "blackwell",
    "NVIDIA A10G": "ampere",
}

SM_SPELLINGS = {
    "sm_90a": "hopper",
    "sm90a": "hopper",
    "sm100a": "blackwell",
    "sm_100a": "blackwell",
    "sm_100f": "blackwell",
    "sm_103a": "blackwell",
    "compute_90a": "hopper",
    "sm_89": "ada",
    "sm_120a": "blackwell_sm120",
    "sm121": "blackwell_sm120",
    "sm_121a": "blackwell_sm120",
    "sm122": "blackwell_sm120",
    "SM 12.1": "blackwell_sm120",
    "sm_9.0": "hopper",
}


@pytest.mark.parametrize("text,arch", NVIDIA_SMI.items())
def test_nvidia_smi_names(text, arch):
    found = arch_by_name(text)
    assert found is not None and found.name == arch


@pytest.mark.parametrize("text,arch", SM_SPELLINGS.items())
def test_cuda_architecture_spellings(text, arch):
    found = arch_by_name(text)
    assert found is not None and found.name == arch


@pytest.mark.parametrize(
    "text",
    [
        "Quadro RTX 6000",
        "NVIDIA Tesla V100-SXM2-32GB",
        "NVIDIA GeForce RTX 2080 Ti",
        "sm75",
        "sm1000",
        "sm95",
        "rtx",
        "h",
        "blackwell_sm130",
    ],
)
def test_unknown_or_pre_ampere_names_are_refused(text):
    """Turing and Volta have no FP8 and are not in the table; nonsense is not guessed."""
    assert arch_by_name(text) is None
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_current", "hardware": text})
    assert err.value.key == "hardware"


def test_new_names_reach_the_spec_and_its_findings():
    """The names are accepted as `hardware:` and the findings are those of the generation."""
    spec = get_recipe({"recipe": "fp8_current", "hardware": "NVIDIA GeForce RTX 5090"})
    assert spec.hardware == "blackwell_sm120"
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "training": "bf16", "hardware": "NVIDIA L20"})
    assert err.value.key == "hardware"
    assert get_recipe({"recipe": "fp8_blockwise", "hardware": "sm_90a"}).hardware == "hopper"


@pytest.mark.parametrize("minor", range(10))
def test_every_sm12_minor_version_is_the_sm12_family(minor):
    assert arch_of_capability(12, minor).name == "blackwell_sm120"
    assert arch_by_name(f"sm12{minor}").name == "blackwell_sm120"


def test_compute_capabilities():
    expected = {(8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada", (9, 0): "hopper"}
    expected |= {(10, 0): "blackwell", (10, 3): "blackwell", (12, 0): "blackwell_sm120"}
    for (major, minor), name in expected.items():
        assert arch_of_capability(major, minor).name == name
    assert arch_of_capability(7, 5) is None and arch_of_capability(9, 5) is None
    for arch in ARCHS:
        for major, minor in arch.sm:
            assert arch_of_capability(major, minor) is arch
            assert arch_by_name(f"sm{major}{minor}") is arch
        assert arch_by_name(arch.name) is arch
        for gpu in arch.gpus:
            assert arch_by_name(gpu) is arch, gpu
