"""`varchain`: a seeded long-trace task made for decode-time KV eviction, and its word-level vocabulary.

A problem binds the first `LAG` variables of a chain; every later variable is the sum, mod 10, of the variable
written just before it and the one written `LAG` steps before that:

    v[j] = (v[j + 1] + v[j + LAG]) mod 10,   j = n - LAG, ..., 1, 0   (n = steps + LAG - 1)

Variables count down, so the trace knows where it ends: the question is the value of v0. The prompt binds
v[n] ... v[n - LAG + 1]; the trace writes one line per step, each variable next to its value wherever it appears
(the operand just written is restated, the old one looked up):

    prompt:  v11 3 v10 7 v9 1 v8 5 v7 2 v6 9 v5 4 v4 6 ?
    trace:   <think> v4 6 + v11 3 = v3 9 ; v3 9 + v10 7 = v2 6 ; ... ; v1 0 + v8 5 = v0 5 ; </think> 5

Each line needs the value of a variable written `LAG` lines (about 70 tokens) back: a cache that drops it makes
the line wrong, and an error in any line carries into v0 (graded exactly: the digit after `</think>`). The
restated operand, the signs and the names are tokens a good eviction method can drop. The difficulty knob is
`steps` (lines, 9 tokens each): the packaged held-out set uses `DEFAULT_STEPS`.

Seeds: a problem is `problem(seed, steps, split)`; the splits draw from disjoint generator streams (`SPLITS`),
and `scripts/train.py` also skips any training problem equal to a packaged held-out one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LAG = 8  # a line reads the variable written LAG lines before its other operand
MODULUS = 10
MAX_NAMES = 64  # variables v0 .. v63: steps + LAG - 1 <= 63
MAX_STEPS = MAX_NAMES - LAG + 1
DEFAULT_STEPS = 52  # the packaged held-out problems: 52 lines, 472 completion tokens (prompt 22, total 494)
SPLITS = {"train": 0, "heldout": 1, "fresh": 2}
TASK_STREAM = 0x5641_5345  # fixed first word of every problem's seed sequence (the task's own stream)

# The vocabulary: special tokens first (ids 0-4, as the chat template and `generate` use them), then words.
PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL = (PAD, IM_START, IM_END, THINK, END_THINK)
WORDS = (UNK, "system", "user", "assistant", "?", "+", "=", ";", *map(str, range(MODULUS)),
         *(f"v{i}" for i in range(MAX_NAMES)))
VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}
VOCAB_SIZE = 96  # the embedding's rows: len(VOCAB) = 87, rounded up to a multiple of 32

# Qwen3's chat template, reduced to what this vocabulary can say (the thinking-off branch writes an empty think
# block, as Qwen3's does); whitespace is not a token here.
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class Chain:
    """One problem: the initial values of v[n] .. v[n - LAG + 1] and every value after them."""

    seed: int
    split: str
    values: tuple[int, ...]  # values[j] = v[j], j = 0 .. n

    @property
    def steps(self) -> int:
        return len(self.values) - LAG

    @property
    def top(self) -> int:  # n, the highest variable index
        return len(self.values) - 1

    @property
    def question(self) -> str:
        """The user message: the bound variables, then '?'."""
        n = self.top
        return " ".join(f"v{j} {self.values[j]}" for j in range(n, n - LAG, -1)) + " ?"

    @property
    def answer(self) -> str:
        return str(self.values[0])

    def lines(self) -> list[str]:
        """The trace's lines, first to last: 'v[j+1] x + v[j+LAG] y = v[j] z ;'."""
        v = self.values
        return [f"v{j + 1} {v[j + 1]} + v{j + LAG} {v[j + LAG]} = v{j} {v[j]} ;" for j in range(self.top - LAG, -1, -1)]

    @property
    def completion(self) -> str:
        """What the model writes after the generation prompt (before its end token)."""
        return f"{THINK} " + " ".join(self.lines()) + f" {END_THINK} {self.answer}"

    def record(self) -> dict:
        """The packaged JSONL row."""
        return {"id": f"{self.split}-{self.seed}", "question": self.question, "answer": self.answer,
                "seed": self.seed, "split": self.split, "steps": self.steps}


def problem(seed: int, steps: int = DEFAULT_STEPS, split: str = "heldout") -> Chain:
    """The problem of `seed` in `split` ("train", "heldout" or "fresh") with `steps` trace lines (1..MAX_STEPS)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {', '.join(SPLITS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps={steps!r} must be an integer in [1, {MAX_STEPS}] (variables v0..v{MAX_NAMES - 1})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    rng = np.random.default_rng([TASK_STREAM, SPLITS[split], seed])
    n = steps + LAG - 1
    values = [0] * (n + 1)
    for j, x in zip(range(n, n - LAG, -1), rng.integers(0, MODULUS, LAG), strict=True):
        values[j] = int(x)
    for j in range(n - LAG, -1, -1):
        values[j] = (values[j + 1] + values[j + LAG]) % MODULUS
    return Chain(seed, split, tuple(values))


def extract_answer(text: str) -> str:
    """The answer of a completion: what follows its last `</think>`, stripped ("" when there is none)."""
    if not isinstance(text, str) or END_THINK not in text:
        return ""
    return text.rsplit(END_THINK, 1)[1].strip()


def build_tokenizer():
    """The task's tokenizer as a `tokenizers.Tokenizer`: one token per word of `VOCAB`, split on whitespace,
    the chat markers and `<think>`/`</think>` matched anywhere (the markers are special: decoding skips them)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: PLC0415 (only to build it)

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, IM_END)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    return tok
