"""The model against HF transformers: logits, prefill + decode, bf16 KL, config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vase_jax as vj
from vase_jax.generate import decode_step, prefill
from vase_jax.target import LAYER_LOOPS, Target


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids), dtype=torch.long),
                  attention_mask=torch.tensor(np.asarray(mask))).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_untied", "tiny_tied"])
def test_logits_match_hf_float32(request, fixture, prompt_batch):
    folder, hf = request.getfixturevalue(fixture)
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(hf, ids, mask)
    real = mask.astype(bool)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ours - ref)[real].max() <= 1e-4
    # a wrong model could not pass this: the logits are not trivially equal
    assert np.abs(ref[real]).max() > 1e-2


@pytest.mark.slow
def test_prefill_plus_decode_equals_full_forward(tiny_tied, prompt_batch):
    folder, _ = tiny_tied
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    ids, mask = jnp.asarray(prompt_batch.input_ids), jnp.asarray(prompt_batch.attention_mask)
    extra = jnp.asarray(np.random.default_rng(0).integers(0, 5000, size=(ids.shape[0], 6)), jnp.int32)
    full_ids = jnp.concatenate([ids, extra], axis=1)
    full_mask = jnp.concatenate([mask, jnp.ones_like(extra)], axis=1)
    full = np.asarray(model(full_ids, full_mask))  # [batch, seq + 6, vocab]

    logits, cache0 = prefill(model, ids, mask, ids.shape[1] + 8, 0)
    np.testing.assert_allclose(np.asarray(logits), full[:, ids.shape[1] - 1], atol=1e-4, rtol=0)
    step = jax.jit(decode_step, static_argnums=(3, 4))
    for loop in LAYER_LOOPS:
        cache = cache0
        for i in range(extra.shape[1]):
            logits, cache = step(model, cache, extra[:, i], "xla", Target.make("cpu", loop))
            np.testing.assert_allclose(np.asarray(logits), full[:, ids.shape[1] + i], atol=1e-4, rtol=0)
        # each row holds its real tokens only (the prompt's padding is not stored)
        np.testing.assert_array_equal(np.asarray(cache.length), np.asarray(mask).sum(1) + extra.shape[1])


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per position from logits, float64."""
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


@pytest.mark.slow
def test_bf16_kl_against_hf(tmp_path, prompt_batch):
    """bf16 next-token distributions: KL(HF_bf16 || ours_bf16), mean over real positions.

    Bound: our bf16 model may differ from HF's bf16 model by rounding order only, so the KL must be of the same
    order as bf16 rounding itself, measured as KL(HF_fp32 || HF_bf16) on the same weights; we allow 2x that plus
    1e-4, and an absolute cap of 2e-2 (a public JAX port checks Qwen3-4B at KL <= 0.015). A larger init std
    (0.2) makes the distributions peaked, so the KL is not trivially zero."""
    folder, hf32 = save_tiny_checkpoint_bf16(tmp_path)
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    real = mask.astype(bool)  # the KLs over the real positions only: [positions, vocab] (padding left out)
    ref32 = hf_logits(hf32, ids, mask)[real].astype(np.float64)
    hf16 = hf32.to(torch.bfloat16)
    ref16 = hf_logits(hf16, ids, mask)[real].astype(np.float64)
    ours = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.bfloat16)
    ours16 = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)))[real].astype(np.float64)
    kl_ours = _kl(ref16, ours16).mean()
    kl_rounding = _kl(ref32, ref16).mean()
    print(f"KL(HF bf16 || ours bf16) = {kl_ours:.3e}; KL(HF fp32 || HF bf16) = {kl_rounding:.3e}")
    assert kl_rounding > 1e-6  # the check has teeth: bf16 rounding is visible
    assert kl_ours <= 2 * kl_rounding + 1e-4
    assert kl_ours <= 2e-2


def save_tiny_checkpoint_bf16(tmp_path):
    from conftest import save_tiny_checkpoint

    folder, hf = save_tiny_checkpoint(tmp_path / "bf16", seed=3, dtype="float32", init_std=0.2)
    hf.to(torch.bfloat16).save_pretrained(folder)  # bf16 weights on disk, as real checkpoints
    hf = hf.float()  # the same (bf16-representable) weights in fp32
    return folder, hf


@pytest.mark.parametrize("size", ["0.6B", "1.7B", "4B", "8B", "14B", "32B"])
def test_every_dense_qwen3_config_parses(size):
    path = Path(vj.__file__).parent / "data" / "configs" / f"Qwen3-{size}.json"
    hf = json.loads(path.read_text())
    cfg = vj.Qwen3Config.from_hf_config(hf)
    assert cfg.num_layers == hf["num_hidden_layers"] and cfg.head_dim == hf["head_dim"]
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.group >= 2
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    hash(cfg)  # static jit argument


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "qwen3_moe"}, "model_type"),
        ({"num_experts": 128}, "num_experts"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_configs_raise_naming_the_field(change, field):
    hf = json.loads((Path(vj.__file__).parent / "data" / "configs" / "Qwen3-0.6B.json").read_text())
    hf.update(change)
    with pytest.raises(ValueError, match=field):
        vj.Qwen3Config.from_hf_config(hf)


@pytest.mark.script
def test_packaged_tokenizer_is_autotokenizers_without_importing_torch(tokenizer, tmp_path):
    """`load_tokenizer` builds the class AutoTokenizer picks for a Qwen3 folder (`Qwen2Tokenizer`) straight from its
    module, which leaves torch unimported (AutoTokenizer's import chain imports it: 1.5 s of a script's start):
    the same ids, decoded text, chat template and special ids. A folder naming another class gets AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(vj.prompts.packaged_tokenizer_dir())
    assert type(tokenizer) is type(reference)
    texts = ["Hello, world!", "raw completion <|endoftext|> café\n", "a   b    ", "cafe\u0301",
             "<think>\nx</think> 你好 мир 🎉 def f(x): return x**2"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    for thinking in (True, False):
        messages = [{"role": "user", "content": "hi"}]
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (151645, 151643, 151669)
    code = "import sys, vase_jax as vj; vj.load_tokenizer(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
    # a folder whose config names another class: AutoTokenizer's choice (here the generic fast class)
    other = tmp_path / "other"
    reference.save_pretrained(other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert not vj.prompts._names_qwen2_tokenizer(str(other))
    assert vj.load_tokenizer(other)("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]


def test_encode_prompts_left_pads_with_chat_template(tokenizer):
    batch = vj.encode_prompts(tokenizer, ["a", "a much longer question with several words"])
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.attention_mask[:, -1].all() and not batch.attention_mask[0, 0]
    assert batch.texts[0].startswith("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
    row = batch.input_ids[0][batch.attention_mask[0].astype(bool)]
    assert tokenizer.decode(row) == batch.texts[0]
    no_think = vj.encode_prompts(tokenizer, ["a"], enable_thinking=False)
    assert "<think>\n\n</think>" in no_think.texts[0]
    with pytest.raises(ValueError, match="texts"):
        vj.encode_prompts(tokenizer, [])
