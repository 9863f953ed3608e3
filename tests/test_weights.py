"""Checkpoint loading: sharded safetensors, corrupted checkpoints, orbax round trip, path resolution."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import vase_jax as vj
from vase_jax import weights

ROOT = Path(__file__).resolve().parents[1]


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids)))


IDS = np.array([[151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30]], np.int32)


def test_sharded_checkpoint_loads(tiny_untied, tmp_path):
    folder, hf = tiny_untied
    hf.save_pretrained(tmp_path, max_shard_size="20MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = vj.Qwen3.from_pretrained(str(tmp_path), dtype=jnp.float32)
    single = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    np.testing.assert_array_equal(_logits(sharded, IDS), _logits(single, IDS))


def _corrupt(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor.*model.layers.1.mlp.up_proj.weight"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((3, 64), np.float32)),
         "model.layers.0.self_attn.k_proj.weight.*shape"),
        (lambda t: t.__setitem__("model.layers.7.mlp.extra.weight", np.zeros((2,), np.float32)),
         "unexpected tensor.*model.layers.7.mlp.extra.weight"),
    ],
    ids=["missing", "misshaped", "extra"],
)
def test_corrupted_checkpoint_names_the_tensor(tiny_untied, tmp_path, edit, message):
    folder, _ = tiny_untied
    bad = _corrupt(folder, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        vj.Qwen3.from_pretrained(str(bad), dtype=jnp.float32)


def test_folder_without_weights_or_config(tmp_path, tiny_untied):
    with pytest.raises(ValueError, match="config.json"):
        vj.Qwen3.from_pretrained(str(tmp_path), dtype=jnp.float32)
    shutil.copy(tiny_untied[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        vj.Qwen3.from_pretrained(str(tmp_path), dtype=jnp.float32)
    with pytest.raises(ValueError, match="not a folder"):
        vj.Qwen3.from_pretrained(str(tmp_path / "nope"), dtype=jnp.float32)


@pytest.mark.script
@pytest.mark.slow
def test_orbax_round_trip_with_convert_script(tiny_tied, tmp_path):
    folder, _ = tiny_tied
    out = tmp_path / "orbax"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), "--model", str(folder), "--out",
                          str(out), "--dtype", "float32"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (out / "params").is_dir() and (out / "config.json").exists()
    restored = vj.Qwen3.from_pretrained(str(out), dtype=jnp.float32)
    original = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    np.testing.assert_array_equal(_logits(restored, IDS), _logits(original, IDS))


def test_orbax_round_trip_bf16(tiny_untied, tmp_path):
    from vase_jax.weights import save_orbax

    folder, _ = tiny_untied
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.bfloat16)
    save_orbax(model, tmp_path / "o", source=folder)
    restored = vj.Qwen3.from_pretrained(str(tmp_path / "o"), dtype=jnp.bfloat16)
    assert restored.embedding[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(_logits(restored, IDS), _logits(model, IDS))


def test_old_orbax_layout_is_refused_with_one_line(tiny_tied, tmp_path):
    """A folder converted before the weights were held per layer (layer weights stacked `[layers, ...]`, layout
    "stacked-layers-v2") is refused with one line that says what to do, before anything is restored."""
    import orbax.checkpoint as ocp

    from vase_jax.config import PARAM_AXES
    from vase_jax.weights import ORBAX_MARKER

    folder, _ = tiny_tied
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    flat = weights.flat_params(model)
    old = {"embedding": flat[("embedding",)], "norm": {"weight": flat[("norm", "weight")]},
           "layers": {kind[1]: np.stack([flat[("layers", i, kind[1])] for i in range(model.cfg.num_layers)])
                      for kind in PARAM_AXES if kind[0] == "layers"}}
    out = tmp_path / "old"
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((out / "params").absolute(), old)
    ckpt.wait_until_finished()
    shutil.copy(folder / "config.json", out / "config.json")
    (out / ORBAX_MARKER).write_text('{"layout": "stacked-layers-v2"}')
    with pytest.raises(ValueError) as info:
        vj.Qwen3.from_pretrained(str(out), dtype=jnp.float32)
    message = str(info.value)
    assert "\n" not in message and "stacked-layers-v2" in message and "scripts/convert.py" in message


def test_tokenizer_from_model_folder_falls_back_to_packaged(tiny_untied):
    tok = vj.load_tokenizer(str(tiny_untied[0]))  # the tiny checkpoint has no tokenizer files
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
