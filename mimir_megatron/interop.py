"""Weights on disk: this project's format and the Hugging Face ``transformers`` ``hrm_text`` format.

- Project weights (``mimir import`` output, ``--checkpoint`` input of ``mimir export``): a
  directory with ``model.yaml`` (the ModelConfig) and ``model.safetensors`` (the full,
  TP-independent state of :mod:`mimir_megatron.model.state`).
- Hugging Face: ``config.json`` + ``model.safetensors`` loadable by
  ``AutoModelForCausalLM.from_pretrained``; the prefix is marked by ``token_type_ids == 1``.

Name mapping (megatron -> transformers on-disk layout, the one ``save_pretrained`` writes and
released HRM-Text checkpoints use), per stack S in {L, H} and layer i:
``S.layers.i.self_attention.linear_qkv`` (rows per head ``[q, gate, k, v]``) ->
``model.S_module.layers.i.attn.gqkv_proj`` (blocks ``[gate; q; k; v]``); ``linear_proj`` ->
``attn.o_proj``; ``mlp.linear_fc1`` ``[gate; up]`` -> ``mlp.gate_up_proj``; ``linear_fc2`` ->
``mlp.down_proj``; ``embedding`` -> ``model.embed_tokens``; ``head`` -> ``lm_head``;
``z_L_init`` -> ``model.z_L_init``. Import also accepts the split in-memory names
(``self_attn.{q,k,v,gate,o}_proj``, ``mlp.{gate,up}_proj``).
Checkpoints are read with safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from mimir_megatron.config import ModelConfig, model_config_from_record
from mimir_megatron.yaml_config import read_yaml
from mimir_megatron.errors import UserError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model.yaml"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "generation_config.json",
)


# -- megatron full state <-> transformers tensors (pure functions) ---------------------------------


def full_state_to_hf(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron full state -> transformers tensors in the fused on-disk layout that
    ``save_pretrained`` writes (``attn.gqkv_proj`` = [gate; q; k; v], ``mlp.gate_up_proj``)."""
    heads, hd, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    hf = {
        "model.embed_tokens.weight": full["embedding.weight"],
        "lm_head.weight": full["head.weight"],
        "model.z_L_init": full["z_L_init"],
    }
    for stack, layers in (("L", cfg.num_layers_L), ("H", cfg.num_layers_H)):
        for i in range(layers):
            src, dst = f"{stack}.layers.{i}.", f"model.{stack}_module.layers.{i}."
            # megatron rows per head: [q, gate, k, v]; transformers: [gate; q; k; v] blocks
            qkv = full[src + "self_attention.linear_qkv.weight"].view(heads, 4, hd, hidden)
            q, gate, k, v = (qkv[:, j].reshape(heads * hd, hidden) for j in range(4))
            hf[dst + "attn.gqkv_proj.weight"] = torch.cat([gate, q, k, v], dim=0)
            hf[dst + "attn.o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
            hf[dst + "mlp.gate_up_proj.weight"] = full[src + "mlp.linear_fc1.weight"]
            hf[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in hf.items()}


def _fuse_split_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept the in-memory transformers names too (``self_attn.q_proj`` ..., ``mlp.up_proj``)."""
    out = dict(hf)
    for name in [n for n in hf if n.endswith("self_attn.q_proj.weight")]:
        base = name[: -len("self_attn.q_proj.weight")]
        parts = [out.pop(base + f"self_attn.{p}_proj.weight") for p in ("gate", "q", "k", "v")]
        out[base + "attn.gqkv_proj.weight"] = torch.cat(parts, dim=0)
        out[base + "attn.o_proj.weight"] = out.pop(base + "self_attn.o_proj.weight")
    for name in [n for n in hf if n.endswith("mlp.up_proj.weight")]:
        base = name[: -len("up_proj.weight")]
        out[base + "gate_up_proj.weight"] = torch.cat(
            [out.pop(base + "gate_proj.weight"), out.pop(base + "up_proj.weight")], dim=0
        )
    return out


def hf_to_full_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    heads, hd, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    hf = _fuse_split_layout(hf)

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise UserError(f"transformers checkpoint lacks tensor {name}")
        return hf[name].float()

    full = {
        "embedding.weight": take("model.embed_tokens.weight"),
        "head.weight": take("lm_head.weight"),
        "z_L_init": take("model.z_L_init"),
    }
    for stack, layers in (("L", cfg.num_layers_L), ("H", cfg.num_layers_H)):
        for i in range(layers):
            src, dst = f"model.{stack}_module.layers.{i}.", f"{stack}.layers.{i}."
            gate, q, k, v = (
                t.reshape(heads, hd, hidden) for t in take(src + "attn.gqkv_proj.weight").chunk(4, 0)
            )
            full[dst + "self_attention.linear_qkv.weight"] = torch.stack(
                [q, gate, k, v], dim=1
            ).reshape(heads * 4 * hd, hidden)
            full[dst + "self_attention.linear_proj.weight"] = take(src + "attn.o_proj.weight")
            full[dst + "mlp.linear_fc1.weight"] = take(src + "mlp.gate_up_proj.weight")
            full[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    return full


def hf_config_dict(cfg: ModelConfig) -> dict:
    if cfg.num_layers_L != cfg.num_layers_H:
        raise UserError(
            "transformers hrm_text uses one layer count for both stacks; this model has "
            f"num_layers_L={cfg.num_layers_L}, num_layers_H={cfg.num_layers_H}"
        )
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers_L,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=1.0 / math.sqrt(cfg.hidden_size),
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        H_cycles=cfg.h_cycles,
        L_cycles=cfg.l_cycles,
        embedding_scale=cfg.effective_embedding_scale,
        prefix_lm=True,
        tie_word_embeddings=False,
    )


def model_config_from_hf(hf_dir: Path) -> ModelConfig:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir} is not a transformers model directory (no config.json)")
    c = json.loads(path.read_text())
    if c.get("model_type") != "hrm_text":
        raise UserError(f"{path}: model_type is {c.get('model_type')!r}, expected 'hrm_text'")
    missing = [k for k in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")
               if k not in c]
    if missing or not (c.get("num_layers_per_stack") or c.get("num_hidden_layers")):
        raise UserError(f"{path} lacks {', '.join(missing) or 'num_hidden_layers'}")
    layers = c.get("num_layers_per_stack") or c["num_hidden_layers"]
    rope = c.get("rope_parameters") or {}
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim", hidden // heads) * heads != hidden:
        raise UserError(f"{path}: head_dim * heads != hidden_size is not supported")
    scale = c.get("embedding_scale") or 1.0 / c.get("initializer_range", 0.02)
    cfg = ModelConfig(
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=c["intermediate_size"],
        num_layers_L=layers,
        num_layers_H=layers,
        h_cycles=c.get("H_cycles", 2),
        l_cycles=c.get("L_cycles", 3),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        norm_eps=c.get("rms_norm_eps", 1e-6),
        embedding_scale=None if math.isclose(scale, math.sqrt(hidden)) else float(scale),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
    )
    cfg.bp_window = min(cfg.bp_window, cfg.depth)
    return cfg.validate()


# -- reading and writing -----------------------------------------------------------------------


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of a sharded ``model.safetensors.index.json``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise UserError(f"{directory} holds no {WEIGHTS_FILE} (safetensors weights are required)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _tmp_sibling(output_dir: Path) -> Path:
    tmp = output_dir.with_name(output_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, output_dir: Path) -> None:
    """Make a fully written directory visible under its final name."""
    if output_dir.exists():
        shutil.rmtree(output_dir)
    tmp.rename(output_dir)


def save_weights(model: torch.nn.Module, output_dir: str | Path) -> Path:
    """Write project weights (full state + model.yaml); all TP ranks call, rank 0 writes."""
    from mimir_megatron.model.state import gather_full_state

    output_dir = Path(output_dir)
    full = gather_full_state(model)
    if _is_writer():
        tmp = _tmp_sibling(output_dir)
        # The shape alone: execution and parallel layout are the loader's choice.
        OmegaConf.save(OmegaConf.create(model.cfg.shape_dict()), tmp / CONFIG_FILE)
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "mimir-megatron-full"})
        _publish(tmp, output_dir)
    return output_dir


def load_weights(weights_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """Build a model from project weights (``overrides`` e.g. ``parallel.tensor_parallel_size=2``)."""
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import load_full_state

    weights_dir = Path(weights_dir)
    cfg = model_config_from_record(read_yaml(weights_dir / CONFIG_FILE, "model settings"), overrides)
    model = build_model(cfg)
    load_full_state(model, read_safetensors_dir(weights_dir), source=str(weights_dir))
    return model


def export_hf(model: torch.nn.Module, output_dir: str | Path,
              tokenizer_dir: str | Path | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Write a transformers ``hrm_text`` directory; all TP ranks call, rank 0 writes.
    ``extra_files`` (name -> text: the model card, ...) appear with the weights, atomically."""
    from mimir_megatron.model.state import gather_full_state

    output_dir = Path(output_dir)
    cfg: ModelConfig = model.cfg
    hf_config = hf_config_dict(cfg)
    hf_tensors = full_state_to_hf(gather_full_state(model), cfg)
    if not _is_writer():
        return output_dir
    try:
        from transformers import HrmTextConfig
    except ImportError as exc:  # pragma: no cover - the hf extra is installed in tests
        raise UserError("exporting needs transformers>=5.24: pip install 'mimir-megatron[hf]'") from exc
    tmp = _tmp_sibling(output_dir)
    config = HrmTextConfig(**hf_config)
    config.architectures = ["HrmTextForCausalLM"]
    config.save_pretrained(tmp)
    save_file(hf_tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer_dir = tokenizer_dir or cfg.tokenizer
    if tokenizer_dir:
        copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        for name in copied:
            shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        log.info("copied tokenizer files %s from %s", copied, tokenizer_dir)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text, encoding="utf-8")
    _publish(tmp, output_dir)
    log.info("exported transformers hrm_text model to %s", output_dir)
    return output_dir


def import_hf(hf_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """Build a model holding the weights of a transformers ``hrm_text`` checkpoint."""
    from mimir_megatron.config import model_config_from_dict
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import load_full_state

    hf_dir = Path(hf_dir)
    cfg = model_config_from_dict(model_config_from_hf(hf_dir).to_dict(), overrides)
    if (hf_dir / "tokenizer.json").is_file():
        cfg.tokenizer = str(hf_dir)
    model = build_model(cfg)
    full = hf_to_full_state(read_safetensors_dir(hf_dir), cfg)
    load_full_state(model, full, source=str(hf_dir))
    return model
