"""The packaged trained model and its task (`varchain`): the generator, the tokenizer, HF parity, solving the task
with `generate` and with transformers, eviction at a budget that never evicts, and train.py's exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.evaluation.config import packaged_model_dir
from vase_jax.tasks import get_task, grade, load_problems, varchain

ROOT = Path(__file__).resolve().parents[1]
MODEL = packaged_model_dir()
sys.path.insert(0, str(ROOT / "scripts"))
import train  # noqa: E402  (scripts/train.py: its prompt and completion ids are what the model was trained on)


# ---- the generator ---------------------------------------------------------------------------------------------
def test_problem_is_deterministic_and_its_trace_computes_the_answer():
    a, b = varchain.problem(7, 12, "heldout"), varchain.problem(7, 12, "heldout")
    assert a == b and a != varchain.problem(7, 12, "train") and a != varchain.problem(8, 12, "heldout")
    assert a.steps == 12 and len(a.lines()) == 12
    values = dict(zip(a.question.split()[:-1:2], map(int, a.question.split()[1::2]), strict=True))
    assert len(values) == varchain.LAG
    for line in a.lines():  # 'v[j+1] x + v[j+LAG] y = v[j] z ;', recomputed from the text alone
        op1, x, _, op2, y, _, res, z, _ = line.split()
        assert int(x) == values[op1] and int(y) == values[op2]
        assert int(op2[1:]) == int(op1[1:]) + varchain.LAG - 1 and int(res[1:]) == int(op1[1:]) - 1
        assert int(z) == (int(x) + int(y)) % 10
        values[res] = int(z)
    assert a.answer == str(values["v0"]) and a.completion.endswith(f"</think> {a.answer}")


@pytest.mark.parametrize("steps, seed, split", [(0, 1, "heldout"), (58, 1, "heldout"), (3, -1, "heldout"),
                                                (3, 1, "test")])
def test_bad_problem_arguments(steps, seed, split):
    with pytest.raises(ValueError, match="steps=|seed=|split="):
        varchain.problem(seed, steps, split)


def test_packaged_heldout_set_is_the_generators_and_disjoint_from_training():
    problems = load_problems("varchain")
    rows = [json.loads(line) for line in (ROOT / "vase_jax/data/tasks/varchain/test.jsonl").read_text().splitlines()]
    assert len(problems) == 200 == len({p.question for p in problems})
    for p, row in zip(problems, rows, strict=True):
        chain = varchain.problem(row["seed"], row["steps"], row["split"])
        assert (p.question, p.answer, p.id) == (chain.question, chain.answer, f"heldout-{row['seed']}")
    skip = train.heldout_questions()
    batch = [train.make_batch(train.TrainConfig(batch=8), step, skip) for step in (0, 1000, 5000)]
    assert all(b["tokens"].shape[0] == 8 for b in batch)
    # a training draw that equals a held-out problem is redrawn: force one by skipping every question of a batch
    first = train.make_batch(train.TrainConfig(batch=2), 3, set())
    again = train.make_batch(train.TrainConfig(batch=2), 3, {_question(first, 0)})
    assert _question(again, 0) != _question(first, 0)


def _question(batch, row: int) -> str:
    inv = {i: w for w, i in varchain.VOCAB.items()}
    words = [inv[int(t)] for t in batch["tokens"][row]]
    return " ".join(words[2:words.index(varchain.IM_END)])


def test_grading_is_exact():
    p = load_problems("varchain", limit=1)[0]
    assert get_task("varchain").grader == "exact"
    assert grade(f"<think> v1 2 ; </think> {p.answer}", p)
    assert not grade(f"<think> v1 2 ; </think> {p.answer} {p.answer}", p)
    assert not grade(f"{p.answer}", p) and not grade("<think> v1 2", p)


# ---- the packaged folder ---------------------------------------------------------------------------------------
def test_packaged_folder_is_a_hf_qwen3_under_20_mb():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] >= 4 and cfg["head_dim"] >= 32
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] >= 2
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (MODEL / name).is_file(), name
    assert sum(f.stat().st_size for f in MODEL.iterdir()) <= 20 * 2**20


def test_tokenizer_gives_the_training_ids():
    tok = vj.load_tokenizer(str(MODEL))
    chains = [varchain.problem(s, 5, "fresh") for s in range(3)]
    batch = vj.encode_prompts(tok, [c.question for c in chains])
    for row, chain in enumerate(chains):
        ids = batch.input_ids[row][batch.attention_mask[row].astype(bool)].tolist()
        assert ids == train.prompt_ids(chain)
        completion = train.completion_ids(chain)
        assert tok.decode(completion[:-1]) == chain.completion
        assert tok(chain.completion, add_special_tokens=False)["input_ids"] == completion[:-1]
    assert tok.eos_token_id == varchain.VOCAB[varchain.IM_END]


@pytest.fixture(scope="module")
def model():
    return vj.Qwen3.from_pretrained(str(MODEL), dtype=jnp.float32)


@pytest.fixture(scope="module")
def heldout():
    tok = vj.load_tokenizer(str(MODEL))
    problems = load_problems("varchain", limit=32)
    return problems, vj.encode_prompts(tok, [p.question for p in problems]), tok


def test_logits_match_hf_float32(model, heldout):
    import torch
    from transformers import AutoModelForCausalLM

    problems, batch, _ = heldout
    chains = [varchain.problem(int(p.id.split("-")[1]), varchain.DEFAULT_STEPS, "heldout") for p in problems[:4]]
    ids = np.asarray(train.encode_batch(chains)["tokens"])  # prompt + the reference completion, right-padded
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    ours = np.asarray(model(jnp.asarray(ids)))
    assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-4
    assert np.abs(ref).max() > 1.0  # a trained head: far from trivially equal


FULL = vj.EvictionConfig("full")


def _generate(model, batch, tok, eviction=FULL, key=0):
    out = vj.generate(model, jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask),
                      key=jax.random.key(key), config=vj.GenerateConfig(max_new_tokens=476, temperature=0.0,
                                                                        eos_token_ids=(tok.eos_token_id,)),
                      eviction=eviction)
    tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    return [tokens[r, :counts[r]].tolist() for r in range(tokens.shape[0])]


@pytest.fixture(scope="module")
def full_tokens(model, heldout):
    _, batch, tok = heldout
    return _generate(model, batch, tok)


def test_full_cache_solves_the_heldout_problems(heldout, full_tokens):
    problems, _, tok = heldout
    correct = [grade(tok.decode(t, skip_special_tokens=True), p) for t, p in zip(full_tokens, problems, strict=True)]
    assert sum(correct) >= 0.95 * len(problems), sum(correct)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["snapkv", "rkv", "rkv_official", "curdkv", "vase_attnv", "vase_dkv", "h2o",
                                    "keydiff"])
def test_budget_above_the_trace_gives_full_tokens(model, heldout, full_tokens, method):
    _, batch, tok = heldout
    assert batch.input_ids.shape[1] + 476 < 512  # prompt + every new token: no row ever reaches N
    got = _generate(model, batch, tok, vj.EvictionConfig(method, budget=512, buffer=32), key=3)
    assert got == full_tokens


@pytest.mark.slow
def test_transformers_loads_the_folder_and_solves_the_task():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    problems = load_problems("varchain", limit=4)
    solved = 0
    for p in problems:
        ids = tok.apply_chat_template([{"role": "user", "content": p.question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = hf.generate(**ids, max_new_tokens=476, do_sample=False)
        solved += grade(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True), p)
    assert solved >= 3


# ---- train.py --------------------------------------------------------------------------------------------------
TINY_TRAIN = ["--layers", "1", "--hidden", "32", "--intermediate", "64", "--heads", "2", "--kv-heads", "1",
              "--head-dim", "16", "--batch", "4", "--steps", "5", "--start-lines", "2", "--max-lines", "3",
              "--warmup", "2", "--save-every", "3"]


def _train(out: Path, *extra: str, process: bool = False) -> list[dict]:
    """scripts/train.py on `out` (in this process, or in a new one: `process`); its log's rows."""
    argv = ["--out", str(out), *TINY_TRAIN, *extra]
    if process:
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *argv], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
    else:
        assert train.main(argv) == 0
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.script
@pytest.mark.slow
def test_train_resumes_exactly_after_an_interruption(tmp_path, capsys):
    """A run stopped after step 3 and resumed in a new process (nothing carried over in memory) logs the losses of
    an uninterrupted run; other settings on the same folder are refused; a second stage starts from the first's
    weights."""
    straight = _train(tmp_path / "a")
    cut = _train(tmp_path / "b", "--stop-after", "3")
    assert max(r["step"] for r in cut) == 3
    resumed = _train(tmp_path / "b", process=True)

    def losses(rows):
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses(resumed)[5] == losses(straight)[5]  # bit-identical: same batches, same restored state
    assert losses(resumed) == losses(straight)
    assert (tmp_path / "b" / "loss.png").stat().st_size > 0
    capsys.readouterr()
    assert train.main(["--out", str(tmp_path / "b"), *TINY_TRAIN[:-2], "--save-every", "3", "--lr", "0.1"]) == 2
    assert "other settings" in capsys.readouterr().err
    # a second stage starts from the first's weights: its first loss is the first run's last, not a fresh start's
    stage2 = _train(tmp_path / "c", "--init", str(tmp_path / "a"))
    first = losses(stage2)[1]
    assert abs(first - losses(straight)[5]) < abs(first - losses(straight)[1])


# ---- the default eval -----------------------------------------------------------------------------------------
@pytest.mark.script
@pytest.mark.slow
def test_default_eval_runs_offline_on_a_small_sample(tmp_path):
    """`python scripts/eval.py` with no model: the packaged one, its task, the default cache settings on one
    problem (methods cut to full and triattention for time; triattention reads the packaged model's calibration),
    with no hub: HF_HUB_OFFLINE and an endpoint that answers nothing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), "--limit", "1", "--methods",
                          "full,triattention", "--budgets", "128", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "varchain" and summary["complete"]
    # the default cache settings: bf16 for every method, K8V8 and K4V4 for full and vase_dkv only
    variants = {(r["method"], r["budget"], r["kv_bits"]) for r in summary["results"]}
    assert variants == {("full", None, "K16V16"), ("triattention", 128, "K16V16"), ("full", None, "K8V8"),
                        ("full", None, "K4V4")}
    full = next(r for r in summary["results"] if r["method"] == "full" and r["kv_bits"] == "K16V16")
    assert full["pass_at_1"] == 1.0 and full["truncation_rate"] == 0.0
    assert (out / "accuracy_vs_budget.png").stat().st_size > 0


def test_hub_id_offline_fails_fast_naming_the_alternatives(monkeypatch):
    from vase_jax import weights

    # offline, the hub client reads the local cache only (local_files_only): no retries, whatever the machine's load
    monkeypatch.setattr(weights, "_hub_offline", lambda: True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1.*packaged model"):
        weights.resolve_checkpoint("nobody-here/no-such-model-xyz")
