"""Hugging Face Qwen3 checkpoints (safetensors, one file or sharded) -> `Qwen3` params, with no torch.
Also orbax save/restore of converted params (`save_orbax`, and `load_pretrained` on a converted folder).

Every HF tensor maps to exactly one parameter through `_hf_key_map`, with a shape check; a missing, unexpected or
misshaped tensor raises `ValueError` naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax.config import Qwen3Config
from vase_jax.model import Qwen3

ORBAX_MARKER = "vase_jax_orbax.json"  # written by save_orbax next to config.json
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json")

Transform = Callable[[np.ndarray], np.ndarray]


def _hf_key_map(cfg: Qwen3Config) -> dict[str, tuple[tuple, Transform, tuple[int, ...]]]:
    """HF tensor name -> (our param path, transform from the HF array, expected HF shape)."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, v = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    ident: Transform = lambda w: w  # noqa: E731
    transpose: Transform = lambda w: w.T  # noqa: E731

    def heads_in(n: int) -> Transform:  # [n*d, e] -> [e, n, d]
        return lambda w: w.T.reshape(e, n, d)

    table = {
        "model.embed_tokens.weight": (("embedding",), ident, (v, e)),
        "model.norm.weight": (("norm", "weight"), ident, (e,)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), transpose, (v, e))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        table |= {
            p + "input_layernorm.weight": (("layers", i, "input_norm", "weight"), ident, (e,)),
            p + "post_attention_layernorm.weight": (("layers", i, "post_attn_norm", "weight"), ident, (e,)),
            p + "self_attn.q_proj.weight": (("layers", i, "attn", "q_proj"), heads_in(hq), (hq * d, e)),
            p + "self_attn.k_proj.weight": (("layers", i, "attn", "k_proj"), heads_in(hkv), (hkv * d, e)),
            p + "self_attn.v_proj.weight": (("layers", i, "attn", "v_proj"), heads_in(hkv), (hkv * d, e)),
            p + "self_attn.o_proj.weight": (("layers", i, "attn", "o_proj"), lambda w: w.T.reshape(hq, d, e),
                                            (e, hq * d)),
            p + "self_attn.q_norm.weight": (("layers", i, "attn", "q_norm", "weight"), ident, (d,)),
            p + "self_attn.k_norm.weight": (("layers", i, "attn", "k_norm", "weight"), ident, (d,)),
            p + "mlp.gate_proj.weight": (("layers", i, "mlp", "gate_proj"), transpose, (f, e)),
            p + "mlp.up_proj.weight": (("layers", i, "mlp", "up_proj"), transpose, (f, e)),
            p + "mlp.down_proj.weight": (("layers", i, "mlp", "down_proj"), transpose, (e, f)),
        }
    return table


def resolve_checkpoint(path_or_hub_id: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id downloaded (config, safetensors, tokenizer files) to the HF cache."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(path_or_hub_id).startswith((".", "/", "~")) or str(path_or_hub_id).count("/") != 1:
        raise ValueError(f"model path {path_or_hub_id!r} is not a folder and not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_hub_id), revision=revision,
                                  allow_patterns=["*.json", "*.safetensors", "merges.txt", "vocab.json"]))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index}: shard files listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights (and no model.safetensors.index.json) in this folder")
    return files


def read_hf_params(folder: Path, cfg: Qwen3Config) -> dict[tuple, np.ndarray]:
    """Read and map every tensor of a HF checkpoint folder -> {our param path: array in our layout}."""
    from safetensors import safe_open

    table = _hf_key_map(cfg)
    params: dict[tuple, np.ndarray] = {}
    seen: dict[str, str] = {}
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="numpy") as fh:
            for name in fh.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears twice ({seen[name]} and {file.name})")
                seen[name] = file.name
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied checkpoints may still store the (identical) head
                if name not in table:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} (not part of a Qwen3 of this config)")
                path, transform, shape = table[name]
                array = fh.get_tensor(name)
                if tuple(array.shape) != shape:
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
                params[path] = transform(array)
    missing = sorted(set(table) - set(seen))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{folder}: missing tensor(s) {', '.join(repr(m) for m in missing[:5])}{more}")
    return params


def _abstract_model(cfg: Qwen3Config, dtype) -> Qwen3:
    return nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def model_from_params(cfg: Qwen3Config, params: dict[tuple, np.ndarray], dtype) -> Qwen3:
    graphdef, state = nnx.split(_abstract_model(cfg, dtype))
    flat = []
    for path, var in nnx.to_flat_state(state):
        if path not in params:
            raise ValueError(f"no weight for parameter {'.'.join(map(str, path))}")
        flat.append((path, var.replace(jnp.asarray(params[path], dtype=dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_pretrained(path_or_hub_id: str, *, dtype=jnp.bfloat16, revision: str | None = None) -> Qwen3:
    folder = resolve_checkpoint(path_or_hub_id, revision)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ValueError(f"{folder}: no config.json")
    cfg = Qwen3Config.from_json_file(config_file)
    if (folder / ORBAX_MARKER).exists():
        return restore_orbax(folder, cfg, dtype)
    return model_from_params(cfg, read_hf_params(folder, cfg), dtype)


# ---- orbax --------------------------------------------------------------------------------------------------------
def save_orbax(model: Qwen3, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None) -> Path:
    """Write `model`'s params with orbax to `out_dir/params`, plus config.json (and tokenizer files from `source`)."""
    import orbax.checkpoint as ocp

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(out / "params", nnx.to_pure_dict(state), force=True)
    ckpt.wait_until_finished()
    if source is not None:
        for name in ("config.json", *TOKENIZER_FILES):
            if (Path(source) / name).exists():
                shutil.copy2(Path(source) / name, out / name)
    if not (out / "config.json").exists():
        raise ValueError(f"save_orbax: {out} has no config.json; pass source= the HF folder it came from")
    with open(out / ORBAX_MARKER, "w") as fh:
        json.dump({"format": "orbax StandardCheckpointer of nnx.to_pure_dict(nnx.state(model, nnx.Param))",
                   "dtype": str(jnp.dtype(model.dtype))}, fh)
    return out


def restore_orbax(folder: Path, cfg: Qwen3Config, dtype) -> Qwen3:
    import orbax.checkpoint as ocp

    graphdef, state = nnx.split(_abstract_model(cfg, dtype))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), nnx.to_pure_dict(state))
    restored = ocp.StandardCheckpointer().restore(Path(folder).absolute() / "params", target)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
