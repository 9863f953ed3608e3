"""Tokenizer loading and chat-template prompt encoding (left padding, as the generate loop expects)."""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources

import numpy as np


def packaged_tokenizer_dir() -> str:
    """The Qwen3 tokenizer files shipped with the package (vocab.json, merges.txt, tokenizer_config.json)."""
    return str(resources.files("vase_jax") / "data" / "tokenizer")


def load_tokenizer(path_or_hub_id: str | os.PathLike | None = None):
    """A transformers tokenizer from a local folder, a hub id, or (None) the packaged Qwen3 tokenizer.

    A model folder without tokenizer files falls back to the packaged Qwen3 tokenizer (all Qwen3 sizes share it).
    """
    path = packaged_tokenizer_dir() if path_or_hub_id is None else str(path_or_hub_id)
    if os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")
    ):
        path = packaged_tokenizer_dir()
    if _names_qwen2_tokenizer(path):
        # the class AutoTokenizer would pick, from its own module: AutoTokenizer's import chain imports torch
        # (about 1.5 s of every script's start), this one does not
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer  # noqa: PLC0415

        return Qwen2Tokenizer.from_pretrained(path)
    from transformers import AutoTokenizer  # noqa: PLC0415 (1.7 s to import: paid by tokenizer users only)

    return AutoTokenizer.from_pretrained(path)


def _names_qwen2_tokenizer(path: str) -> bool:
    """Whether `path` is a local folder whose tokenizer_config.json names `Qwen2Tokenizer` (every Qwen3 model's,
    and the packaged one's), under transformers 5 or later (where that class is the tokenizers-backed one that
    AutoTokenizer returns; before 5 AutoTokenizer returns `Qwen2TokenizerFast` instead)."""
    import transformers  # noqa: PLC0415 (the package's own import is light; torch comes with its models)

    config = os.path.join(path, "tokenizer_config.json")
    if int(transformers.__version__.split(".")[0]) < 5 or not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as fh:
            settings = json.load(fh)
    except ValueError:  # not JSON: AutoTokenizer reports it
        return False
    return isinstance(settings, dict) and settings.get("tokenizer_class") == "Qwen2Tokenizer"


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    input_ids: np.ndarray  # [batch, seq] int32, left-padded
    attention_mask: np.ndarray  # [batch, seq] int32, 0 on padding
    texts: tuple[str, ...]  # the templated prompt strings

    @property
    def lengths(self) -> np.ndarray:  # [batch] real tokens per row
        return self.attention_mask.sum(axis=1)


def encode_prompts(tokenizer, texts: list[str] | tuple[str, ...], *, chat: bool = True,
                   enable_thinking: bool = True) -> PromptBatch:
    """Each text becomes one user message under the Qwen3 chat template (with the generation prompt), or the raw
    text if `chat=False`; rows are left-padded to the longest."""
    if isinstance(texts, str) or not len(texts):
        raise ValueError("encode_prompts: texts must be a non-empty list of strings")
    if chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=enable_thinking)
            for t in texts
        ]
    else:
        prompts = list(texts)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise ValueError(f"encode_prompts: texts {empty} encode to no tokens")
    width = max(len(row) for row in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = np.full((len(ids), width), pad, np.int32)
    mask = np.zeros((len(ids), width), np.int32)
    for r, row in enumerate(ids):
        input_ids[r, width - len(row):] = row
        mask[r, width - len(row):] = 1
    return PromptBatch(input_ids, mask, tuple(prompts))
