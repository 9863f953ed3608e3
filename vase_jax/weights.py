"""Hugging Face Qwen3 checkpoints (safetensors, one file or sharded) -> `Qwen3` params, with no torch.
Also orbax save/restore of converted params (`save_orbax`, and `load_params` on a converted folder).

Every HF tensor maps to exactly one parameter through `hf_key_map` (`model.layers.{i}.*` to layer i's own arrays,
`("layers", i, name)`), with a shape check; a missing, unexpected or misshaped tensor raises `ValueError` naming
it. The same table exports our parameters under HF names (`hf_state_dict`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from huggingface_hub import snapshot_download
from safetensors import safe_open

from vase_jax.config import Qwen3Config, param_shapes
from vase_jax.sharding import param_shardings

ORBAX_MARKER = "vase_jax_orbax.json"  # written by save_orbax next to config.json
ORBAX_LAYOUT = "per-layer-v3"  # one array per layer and weight (paths ("layers", i, name)), matrices [out, in]
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json")

Transform = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Entry:
    """How one HF tensor maps to one of our parameters, in both directions."""

    path: tuple  # our parameter path (`vase_jax.config.param_axes`)
    hf_shape: tuple[int, ...]
    to_ours: Transform  # HF array -> our layout
    to_hf: Transform  # our layout -> HF array


def hf_key_map(cfg: Qwen3Config) -> dict[str, Entry]:
    """HF tensor name -> `Entry`: the one table for loading (`read_hf_params`) and exporting (`hf_state_dict`)."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, v = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    ident: Transform = lambda w: w  # noqa: E731

    table = {
        "model.embed_tokens.weight": Entry(("embedding",), (v, e), ident, ident),
        "model.norm.weight": Entry(("norm", "weight"), (e,), ident, ident),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = Entry(("lm_head",), (v, e), ident, ident)
    heads_out = {n: ((lambda w, n=n: w.reshape(n, d, e)), (lambda w, n=n: w.reshape(n * d, e))) for n in {hq, hkv}}
    o_proj = (lambda w: w.reshape(e, hq, d)), (lambda w: w.reshape(e, hq * d))  # HF [e, hq*d] <-> [e, hq, d]
    per_layer = {  # HF name within a layer -> (our name within a layer, HF shape, to ours, to HF)
        "input_layernorm.weight": ("input_norm", (e,), ident, ident),
        "post_attention_layernorm.weight": ("post_attn_norm", (e,), ident, ident),
        "self_attn.q_proj.weight": ("q_proj", (hq * d, e), *heads_out[hq]),
        "self_attn.k_proj.weight": ("k_proj", (hkv * d, e), *heads_out[hkv]),
        "self_attn.v_proj.weight": ("v_proj", (hkv * d, e), *heads_out[hkv]),
        "self_attn.o_proj.weight": ("o_proj", (e, hq * d), *o_proj),
        "self_attn.q_norm.weight": ("q_norm", (d,), ident, ident),
        "self_attn.k_norm.weight": ("k_norm", (d,), ident, ident),
        "mlp.gate_proj.weight": ("gate_proj", (f, e), ident, ident),
        "mlp.up_proj.weight": ("up_proj", (f, e), ident, ident),
        "mlp.down_proj.weight": ("down_proj", (e, f), ident, ident),
    }
    for i in range(cfg.num_layers):
        for name, (ours, shape, to_ours, to_hf) in per_layer.items():
            table[f"model.layers.{i}.{name}"] = Entry(("layers", i, ours), shape, to_ours, to_hf)
    return table


HUB_PROBE_SECONDS = 3.0  # how long `resolve_checkpoint` waits for the hub before it uses the local cache alone


def resolve_checkpoint(path_or_hub_id: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id downloaded (config, safetensors, tokenizer files) to the HF cache.

    Offline (`HF_HUB_OFFLINE=1`, or the hub not answering a connection within `HUB_PROBE_SECONDS`) the local HF
    cache alone is read, so an unreachable hub costs seconds, not the client's minute of retries; a model found
    nowhere is a ValueError that names the ways to run without the hub."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(path_or_hub_id).startswith((".", "/", "~")) or str(path_or_hub_id).count("/") != 1:
        raise ValueError(f"model path {path_or_hub_id!r} is not a folder and not a hub id of the form 'org/name'")
    offline = _hub_offline()
    try:
        return Path(snapshot_download(str(path_or_hub_id), revision=revision, local_files_only=offline,
                                      allow_patterns=["*.json", "*.safetensors", "merges.txt", "vocab.json"]))
    except Exception as e:  # the hub client's errors: no connection, not cached, no such repo, no access
        where = "the hub is not reachable and it is not in the local Hugging Face cache" if offline else (
            f"the Hugging Face hub answered {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        raise ValueError(
            f"{path_or_hub_id!r} could not be loaded: {where}. Without the hub: pass a local folder that holds "
            "config.json and *.safetensors (and the tokenizer files), set HF_HUB_OFFLINE=1 to read the cache only, "
            "or run the packaged model (`python scripts/eval.py` with no --model)") from None


def _hub_offline() -> bool:
    """True when `HF_HUB_OFFLINE` is set or the hub's endpoint takes no TCP connection within HUB_PROBE_SECONDS."""
    import socket  # noqa: PLC0415 (only hub ids need it)
    from urllib.parse import urlparse  # noqa: PLC0415

    from huggingface_hub import constants  # noqa: PLC0415

    if constants.HF_HUB_OFFLINE:
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=HUB_PROBE_SECONDS):
            return False
    except OSError:
        return True


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


def index_hf_tensors(folder: Path, cfg: Qwen3Config) -> dict[str, tuple[Path, Entry]]:
    """HF tensor name -> (its safetensors file, its `Entry`), from the files' headers only (no tensor is read):
    every tensor checked (no duplicate, unexpected, misshaped or missing one)."""
    table = hf_key_map(cfg)
    found: dict[str, tuple[Path, Entry]] = {}
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
                entry = table[name]
                shape = tuple(fh.get_slice(name).get_shape())
                if shape != entry.hf_shape:
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {shape}, expected {entry.hf_shape}")
                found[name] = (file, entry)
    missing = sorted(set(table) - set(seen))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{folder}: missing tensor(s) {', '.join(repr(m) for m in missing[:5])}{more}")
    return found


def read_hf_params(folder: Path, cfg: Qwen3Config, dtype=np.float32) -> dict[tuple, np.ndarray]:
    """Read and map every tensor of a HF checkpoint folder -> {our param path: array in our layout and `dtype`}."""
    found = index_hf_tensors(folder, cfg)
    dtype = np.dtype(dtype)
    params = {}
    for file in sorted({f for f, _ in found.values()}):
        with safe_open(str(file), framework="numpy") as fh:
            for name, (_, entry) in ((n, v) for n, v in found.items() if v[0] == file):
                params[entry.path] = np.asarray(entry.to_ours(fh.get_tensor(name)), dtype)
    return params


def read_hf_params_sharded(folder: Path, cfg: Qwen3Config, dtype, shardings: dict) -> dict[tuple, jax.Array]:
    """Like `read_hf_params`, but every parameter is a `jax.Array` placed with `shardings[path]` as it is read:
    each device's shard is cut from its HF tensor (one on the host at a time), so no device and no host ever
    holds the whole model. With several processes each reads only the shards of its own devices."""
    found = index_hf_tensors(folder, cfg)
    dtype = np.dtype(dtype)
    sources = {entry.path: (file, name, entry) for name, (file, entry) in found.items()}

    def shard(path: tuple, index: tuple) -> np.ndarray:
        file, name, entry = sources[path]
        with safe_open(str(file), framework="numpy") as fh:
            return np.asarray(entry.to_ours(fh.get_tensor(name))[index], dtype)

    return {path: jax.make_array_from_callback(shape, shardings[path], functools.partial(shard, path))
            for path, shape in param_shapes(cfg).items()}


def hf_state_dict(params: dict[tuple, np.ndarray], cfg: Qwen3Config) -> dict[str, np.ndarray]:
    """Our parameters ({path: array}, e.g. `flat_params(model)`) under HF names and layouts (float32)."""
    out = {}
    for name, entry in hf_key_map(cfg).items():
        out[name] = entry.to_hf(np.asarray(params[entry.path], np.float32))
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def flat_params(model) -> dict[tuple, jax.Array]:
    """{parameter path: array} of a `Qwen3`."""
    return {path: var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_params(path_or_hub_id: str, *, dtype=jnp.bfloat16, revision: str | None = None, mesh=None):
    """(config, {parameter path: array}) of a HF checkpoint folder, a hub id, or a `scripts/convert.py` folder.

    `mesh` (a `("data", "model")` mesh, `vase_jax.sharding`): every array is placed with its sharding as it is
    read (`read_hf_params_sharded`, or orbax restoring into target shardings); checked against `cfg` first."""
    folder = resolve_checkpoint(path_or_hub_id, revision)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ValueError(f"{folder}: no config.json")
    cfg = Qwen3Config.from_json_file(config_file)
    shardings = None
    if mesh is not None:
        shardings = param_shardings(cfg, mesh)
    if (folder / ORBAX_MARKER).exists():
        return cfg, restore_orbax(folder, cfg, dtype, shardings)
    if shardings is not None:
        return cfg, read_hf_params_sharded(folder, cfg, jnp.dtype(dtype), shardings)
    return cfg, read_hf_params(folder, cfg, jnp.dtype(dtype))


# ---- orbax --------------------------------------------------------------------------------------------------------
def save_orbax(model, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None) -> Path:
    """Write a `Qwen3`'s params with orbax to `out_dir/params`, plus config.json (and tokenizer files from `source`)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (2.7 s to import; only converted folders need it)

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
                   "layout": ORBAX_LAYOUT, "dtype": str(jnp.dtype(model.dtype))}, fh)
    return out


def restore_orbax(folder: Path, cfg: Qwen3Config, dtype, shardings: dict | None = None) -> dict[tuple, jax.Array]:
    """{parameter path: array} restored from a `save_orbax` folder, in `dtype`; with `shardings` ({path:
    sharding}) orbax reads each array straight into its shards."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (2.7 s to import; only converted folders need it)

    with open(folder / ORBAX_MARKER) as fh:
        layout = json.load(fh).get("layout")
    if layout != ORBAX_LAYOUT:
        raise ValueError(f"{folder}: converted by an older vase-jax (parameter layout {layout!r}); "
                         f"convert the HF checkpoint again with scripts/convert.py (layout {ORBAX_LAYOUT!r})")
    target: dict = {}
    for path, shape in param_shapes(cfg).items():
        node = target
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[path] if shardings else None)
    restored = ocp.StandardCheckpointer().restore(Path(folder).absolute() / "params", target)
    return {path: functools.reduce(lambda node, part: node[part], path, restored) for path in param_shapes(cfg)}
