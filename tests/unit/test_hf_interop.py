"""Interop with transformers `hrm_text`: logits parity, import/export round trips, refusals."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_config

from mimir_megatron.batch import single_sample_batch
from mimir_megatron.errors import UserError
from mimir_megatron.interop import export_hf, import_hf, load_weights, save_weights
from mimir_megatron.model import build_model
from mimir_megatron.model.state import gather_full_state


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def hf_logits(hf_model, batch, mask):
    return hf_model(
        input_ids=batch.input_ids,
        attention_mask=mask.long(),
        token_type_ids=batch.prefix_mask.long(),
        use_cache=False,
    ).logits


@pytest.fixture(scope="module")
def rows():
    """Rows with different prefix and response lengths, right-padded."""
    g = torch.Generator().manual_seed(7)
    prefix = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 3, 8, 12)]
    response = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (9, 2, 5, 2)]
    return single_sample_batch(prefix, response, seq_len=16)


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("seed=11")).eval()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    export_hf(model, out)
    return out


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def test_exported_directory_is_a_transformers_hrm_text(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "hrm_text"
    assert config["vocab_size"] == 250  # padding rows are not exported
    assert config["embedding_scale"] == pytest.approx(8.0)
    assert type(load_hf(exported)).__name__ == "HrmTextForCausalLM"


def test_logits_match_transformers(model, exported, rows):
    hf = load_hf(exported)
    valid = rows.segment_ids > 0
    with torch.no_grad():
        ours = model(rows).logits
        ref = hf_logits(hf, rows, valid)
    assert ours.shape == ref.shape == (4, 16, 250)
    assert rel_err(ours[valid], ref[valid]) <= 1e-5


@pytest.mark.parametrize("h_cycles,l_cycles", [(2, 1), (3, 2), (1, 4)])
def test_changed_schedule_at_inference_matches_transformers(model, exported, rows, h_cycles, l_cycles):
    hf = load_hf(exported)
    hf.config.H_cycles, hf.config.L_cycles = h_cycles, l_cycles
    hf.model.L_bp_cycles_padded = [1] * h_cycles
    valid = rows.segment_ids > 0
    with torch.no_grad():
        ours = model(rows, h_cycles=h_cycles, l_cycles=l_cycles).logits
        ref = hf_logits(hf, rows, valid)
    assert rel_err(ours[valid], ref[valid]) <= 1e-5


def test_export_uses_the_layout_transformers_writes(model, exported, tmp_path):
    """Same tensor names and shapes as transformers' own save_pretrained of this model."""
    hf = load_hf(exported)
    hf.save_pretrained(tmp_path / "resaved")
    from mimir_megatron.interop import read_safetensors_dir

    ours, theirs = read_safetensors_dir(exported), read_safetensors_dir(tmp_path / "resaved")
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_import_of_export_is_identity(model, exported):
    imported = import_hf(exported)
    before, after = gather_full_state(model), gather_full_state(imported)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.fixture(scope="module")
def transformers_model():
    """An hrm_text model initialised by transformers itself (not by our exporter)."""
    config = transformers.HrmTextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, head_dim=16, H_cycles=2, L_cycles=3, initializer_range=0.125,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(3)
    hf = transformers.HrmTextForCausalLM(config).eval()
    with torch.no_grad():
        hf.model.z_L_init.normal_()  # transformers initialises it to zeros; make it matter
    return hf


@pytest.mark.parametrize("layout", ["fused", "sharded", "split"])
def test_import_of_a_transformers_initialised_model(transformers_model, tmp_path, rows, layout):
    """Weights made by transformers give the same logits here, in every layout a directory can
    hold: the fused one ``save_pretrained`` writes (``attn.gqkv_proj``, ``mlp.gate_up_proj``), in
    one file or in shards with ``model.safetensors.index.json`` (a large model's), and the split
    in-memory names (``self_attn.{q,k,v,gate,o}_proj``, ``mlp.{gate,up}_proj``) of a state dict
    saved as it is. All projections of this shape are square or equal in shape, so only the
    logits tell a swapped pair apart."""
    hf = transformers_model
    if layout == "fused":
        hf.save_pretrained(tmp_path / "hf")
    elif layout == "sharded":
        hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
        assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    else:
        from safetensors.torch import save_file

        hf.config.save_pretrained(tmp_path / "hf")
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.L_module.layers.0.mlp.up_proj.weight" in state  # the split names indeed
        save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    ours = import_hf(tmp_path / "hf").eval()
    valid = rows.segment_ids > 0
    with torch.no_grad():
        err = rel_err(ours(rows).logits[valid], hf_logits(hf, rows, valid)[valid])
    assert err <= 1e-5, f"{layout} layout: logits differ from transformers' by {err:.2e} (relative)"


def test_project_weights_round_trip(model, tmp_path, rows):
    save_weights(model, tmp_path / "w")
    again = load_weights(tmp_path / "w")
    with torch.no_grad():
        assert torch.equal(again(rows).logits, model(rows).logits)


def test_weights_of_another_shape_are_refused(model, tmp_path):
    save_weights(model, tmp_path / "w")
    with pytest.raises(UserError, match=r"(?s)does not fit this model.*linear_fc1.weight: shape \(256, 64\), model expects \(512, 64\)"):
        load_weights(tmp_path / "w", ["ffn_hidden_size=256"])


def test_missing_weights_file_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "hrm_text"}))
    with pytest.raises(UserError):
        import_hf(tmp_path)


def test_not_an_hrm_text_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="expected 'hrm_text'"):
        import_hf(tmp_path)
