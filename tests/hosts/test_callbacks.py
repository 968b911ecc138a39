"""Scale-refresh callbacks on CPU, against the plugin's FP8 emulation backend.

The scenario of NVIDIA/TransformerEngine issue 982: a delayed-scaling run resumes from a checkpoint
whose weights are restored but whose FP8 scaling state is not what the tensors need now
(here: fresh state, scale 1, as when the checkpoint carries no FP8 metadata). Activations
above 448 then saturate on the first step. The refresh runs calibration passes before the
first optimizer step and the scales become fp8_max / amax again.

Lightning is the real ``lightning.pytorch`` 2.4 (NeMo 2's); Megatron-Bridge's callback
manager is Bridge 0.6.2's real ``training/callbacks.py`` loaded by file path (it imports
only the standard library).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from conftest import load_te_recipe_module, upstream_file
from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.hosts.bridge.callback import FP8ScaleRefreshBridgeCallback
from nemo_fp8_plugin.hosts.nemo2.callback import FP8ScaleRefreshCallback
from nemo_fp8_plugin.hosts.refresh import ScaleRefresher, refresh_fp8_scales
from nemo_fp8_plugin.numerics import convert_to_fp8_emulation, emulated_modules

pytestmark = pytest.mark.host

INPUT_SCALE = 1000.0  # activations well above E4M3's 448: scale 1 saturates them


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 64, generator=g) * INPUT_SCALE for _ in range(n)]


def _scales(model):
    return {
        (name, role): float(state.scale)
        for name, m in emulated_modules(model)
        for role, state in sorted(m.fp8_states.items())
    }


def _resumed(trained_state_dict):
    """A fresh delayed-scaling model with restored weights and default FP8 state."""
    model = _model(seed=123)
    model.load_state_dict(trained_state_dict)
    return convert_to_fp8_emulation(model, get_recipe("fp8_delayed"))


def test_refresh_changes_the_scales_after_a_resume():
    weights = _model().state_dict()
    model = _resumed(weights)
    batches = _batches()
    before = _scales(model)
    assert set(before.values()) == {1.0}
    report = refresh_fp8_scales(model, batches, passes=4)
    after = _scales(model)
    assert report.backend == "emulation" and report.passes == 4 and report.modules == 2
    assert report.scales_changed == 4  # input and weight of both layers; grads need a backward
    first = dict(emulated_modules(model))["0"]
    # Independent reference: scale = 448 / max over the window (fp8_delayed: history 1024, max).
    w_amax = weights["0.weight"].abs().max()
    x_amax = torch.stack([b.abs().max() for b in batches]).max()
    assert after[("0", "weight")] == pytest.approx(float(448.0 / w_amax), rel=1e-6)
    assert after[("0", "input")] == pytest.approx(float(448.0 / x_amax), rel=1e-6)
    assert after[("0", "grad_output")] == 1.0
    assert first.weight.grad is None  # no gradients were computed


def test_refreshed_first_step_matches_high_precision_better():
    """What the refresh buys: the first FP8 forward after resume no longer saturates."""
    weights = _model().state_dict()
    reference = _model()
    x = _batches(1, seed=7)[0]
    with torch.no_grad():
        want = reference(x)
        stale = _resumed(weights)(x)
        fresh_model = _resumed(weights)
        refresh_fp8_scales(fresh_model, _batches(), passes=4)
        fresh = fresh_model(x)
    err_stale = (stale - want).abs().max() / want.abs().max()
    err_fresh = (fresh - want).abs().max() / want.abs().max()
    assert err_stale > 0.3  # saturated at 448: far off
    assert err_fresh < 0.1  # FP8 rounding only
    print(
        f"relative error of the first step: stale scales {err_stale:.3f}, refreshed {err_fresh:.4f}"
    )


def test_no_fp8_modules_is_reported_not_faked():
    assert refresh_fp8_scales(_model(), _batches(1)).backend == "none"


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"calibration_steps": 0}, "calibration_steps"),
        ({"calibration_steps": True}, "calibration_steps"),
        ({"after_optimizer_step": "pkg.hook"}, "after_optimizer_step"),
    ],
)
def test_bad_arguments(kwargs, key):
    with pytest.raises(FP8ConfigError) as err:
        ScaleRefresher("fp8_delayed", **kwargs)
    assert err.value.key == key


def test_resume_without_batches_is_refused_not_skipped():
    model = _resumed(_model().state_dict())
    refresher = ScaleRefresher("fp8_delayed")
    with pytest.raises(FP8ConfigError, match="calibration_batches"):
        refresher.refresh(model, fallback_batch=iter(_batches()))


def test_only_delayed_scaling_resumes_are_refreshed():
    assert ScaleRefresher("fp8_delayed").wants_refresh(resumed=True)
    assert not ScaleRefresher("fp8_delayed").wants_refresh(resumed=False)
    assert not ScaleRefresher("fp8_blockwise").wants_refresh(resumed=True)
    assert not ScaleRefresher("fp8_delayed", refresh_on_resume=False).wants_refresh(resumed=True)


# --------------------------------------------------------------------------- TE check


@pytest.fixture
def te_installed(tmp_path, monkeypatch):
    """``transformer_engine.common.recipe`` importable as TE 2.20.2's real recipe module (the
    package shells above it are empty modules), imported with the FP32 variable unset."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    recipe = load_te_recipe_module(tmp_path, name="transformer_engine.common.recipe")
    te_pkg, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    common.recipe = recipe
    te_pkg.common = common
    monkeypatch.setitem(sys.modules, "transformer_engine", te_pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    return recipe


def test_start_of_training_check_fails_fast(te_installed):
    cb = FP8ScaleRefreshCallback("fp8_blockwise")
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        cb.setup(trainer=None, pl_module=None, stage="fit")
    FP8ScaleRefreshCallback("fp8_subchannel").setup(None, None, "fit")  # pow2 is what it needs


def test_check_without_te_reports_it_did_not_run():
    assert "transformer_engine" not in sys.modules
    assert ScaleRefresher("fp8_blockwise").verify() is False


# --------------------------------------------------------------------------- Lightning


def _lightning_module(model):
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean() * 1e-6

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Lit()


def _trainer(tmp_path, callback, max_steps):
    import lightning.pytorch as pl

    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )


def test_lightning_callback_refreshes_on_resume_and_runs_the_hook(tmp_path):
    data = torch.utils.data.DataLoader(torch.cat(_batches(8)), batch_size=8)
    first = _lightning_module(convert_to_fp8_emulation(_model(), get_recipe("fp8_delayed")))
    trainer = _trainer(tmp_path, FP8ScaleRefreshCallback("fp8_delayed"), max_steps=3)
    trainer.fit(first, data)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)

    calls = []
    cb = FP8ScaleRefreshCallback(
        "fp8_delayed",
        calibration_steps=3,
        after_optimizer_step=lambda tr, mod: calls.append(tr.global_step),
    )
    resumed = _lightning_module(convert_to_fp8_emulation(_model(seed=5), get_recipe("fp8_delayed")))
    assert set(_scales(resumed.net).values()) == {1.0}
    _trainer(tmp_path, cb, max_steps=6).fit(resumed, data, ckpt_path=str(ckpt))
    report = cb.refresher.last_report
    assert report is not None and report.backend == "emulation" and report.passes == 3
    assert report.scales_changed == 4
    assert calls == [4, 5, 6]  # once per optimizer step after the resume
    # The accounting is recorded and consistent; what it amounts to is a benchmark
    # (benchmarks/bench_refresh.py, docs/performance.md), not a test: wall-clock ratios on
    # a shared machine are not reproducible.
    stats = cb.stats
    assert stats["steps"] == 3
    assert stats["step_seconds"] > 0 and stats["refresh_seconds"] > 0
    assert stats["hook_seconds"] >= 0
    assert stats["overhead_fraction"] == pytest.approx(
        (stats["hook_seconds"] + stats["refresh_seconds"]) / stats["step_seconds"]
    )


def test_lightning_callback_leaves_a_fresh_run_alone(tmp_path):
    data = torch.utils.data.DataLoader(torch.cat(_batches(4)), batch_size=8)
    cb = FP8ScaleRefreshCallback("fp8_delayed")
    _trainer(tmp_path, cb, max_steps=2).fit(
        _lightning_module(convert_to_fp8_emulation(_model(), get_recipe("fp8_delayed"))), data
    )
    assert cb.refresher.last_report is None and cb.stats["steps"] == 2


# --------------------------------------------------------------------------- Megatron-Bridge


@pytest.fixture(scope="module")
def bridge_callbacks(tmp_path_factory):
    path = upstream_file(
        "megatron_bridge-0.6.2-*.whl",
        "megatron/bridge/training/callbacks.py",
        tmp_path_factory.mktemp("bridge"),
    )
    spec = importlib.util.spec_from_file_location("bridge_callbacks_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _context(cbmod, model, step):
    # Bridge's GlobalState: only ``train_state.step`` is read by the callback.
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=step))
    return cbmod.CallbackContext(state=state, model=[model])


def test_bridge_manager_registers_and_fires_our_callback(bridge_callbacks):
    calls = []
    model = _resumed(_model().state_dict())
    cb = FP8ScaleRefreshBridgeCallback(
        "fp8_delayed",
        calibration_batches=_batches(),
        after_optimizer_step=lambda ctx, mod: calls.append(mod),
    )
    manager = bridge_callbacks.CallbackManager()
    manager.add(cb)
    for event in ("on_train_start", "on_train_step_start", "on_train_step_end"):
        assert manager.has_callbacks(event)
    assert not manager.has_callbacks("on_eval_start")
    ctx = _context(bridge_callbacks, model, step=100)
    manager.fire("on_train_start", ctx)
    assert cb.refresher.last_report.scales_changed == 4
    manager.fire("on_train_step_start", ctx)
    manager.fire("on_train_step_end", ctx)
    assert calls == [model] and cb.stats["steps"] == 1


def test_bridge_resume_without_batches_is_refused(bridge_callbacks):
    manager = bridge_callbacks.normalize_callbacks([FP8ScaleRefreshBridgeCallback("fp8_delayed")])
    with pytest.raises(FP8ConfigError, match="calibration_batches"):
        manager.fire(
            "on_train_start", _context(bridge_callbacks, _resumed(_model().state_dict()), step=3)
        )


def test_bridge_skipped_iteration_is_not_a_step(bridge_callbacks):
    cb = FP8ScaleRefreshBridgeCallback("fp8_blockwise")
    ctx = _context(bridge_callbacks, _model(), step=1)
    ctx.skipped_iter = True
    cb.on_train_step_end(ctx)
    assert cb.stats["steps"] == 0
