#!/usr/bin/env python
"""Train the packaged `varchain` model: a small Qwen3 that writes the task's traces (`vase_jax.tasks.varchain`).

    python scripts/train.py --out runs/train-varchain                    # resumes where it stopped
    python scripts/train.py --out runs/train-varchain --export vase_jax/data/models/varchain-qwen3

Deterministic from `--seed`: the initial weights are drawn with NumPy, batch i is drawn from (seed, i) alone, and
each training problem is a `varchain.problem(seed, steps, "train")` (any equal to a packaged held-out problem is
skipped). The loss is the mean cross-entropy of the completion's tokens (the prompt's random bindings are not
predicted). A curriculum grows the longest trace of a batch from `--start-lines` to `--max-lines` over the first
`--ramp` of the steps; half of each batch is drawn from the upper half of the current range.

Every `--save-every` steps an orbax checkpoint (weights, optimizer state, step) is written; a run killed at any
point (even `kill -9`) restarts from the last one and gives the same losses as an uninterrupted run. OUT/log.jsonl
holds one line per step (loss, lines, seconds) and OUT/loss.png the curve. `--export DIR` writes the Hugging Face
folder (config.json, model.safetensors, tokenizer, generation_config.json) of the last checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

PROG = "train.py"
TRAIN_STREAM = 0x545241494E  # the batch sampler's own first seed word


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that fixes the run's numbers (saved beside the checkpoints; a resume must match it)."""

    seed: int = 0
    steps: int = 3000
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    start_lines: int = 1  # one line first: the copy heads form within ~200 steps on ~35-token sequences, and
    hold: int = 400  # not in 1000 when training starts at 4+ lines or ramps up at once (the values stay at
    max_lines: int = 40  # chance, 2.3 nats each): `hold` steps at start_lines, then the ramp
    ramp: float = 0.5  # of `steps`: when the curriculum reaches max_lines
    hidden: int = 128
    intermediate: int = 512
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    init: str = ""  # another run's --out: start from its last checkpoint's weights (a fresh optimizer)

    def model_config(self):
        from vase_jax.config import Qwen3Config
        from vase_jax.tasks import varchain

        return Qwen3Config(vocab_size=varchain.VOCAB_SIZE, hidden_size=self.hidden,
                           intermediate_size=self.intermediate, num_layers=self.layers, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                           tie_word_embeddings=True, max_position_embeddings=1024,
                           eos_token_id=varchain.VOCAB[varchain.IM_END])

    def lines_at(self, step: int) -> int:
        """The curriculum: the longest trace (in lines) of batch `step`."""
        ramp_steps = max(1, int(self.ramp * self.steps) - self.hold)
        frac = min(1.0, max(0, step - self.hold) / ramp_steps)
        return int(round(self.start_lines + frac * (self.max_lines - self.start_lines)))


# ---- data ---------------------------------------------------------------------------------------------------------
def prompt_ids(chain) -> list[int]:
    """The prompt as `encode_prompts` makes it with the task's tokenizer: the chat template around the question."""
    from vase_jax.tasks import varchain as vc

    words = [vc.IM_START, "user", *chain.question.split(), vc.IM_END, vc.IM_START, "assistant"]
    return [vc.VOCAB[w] for w in words]


def completion_ids(chain) -> list[int]:
    """What the model is trained to write after the prompt: the completion and its end token."""
    from vase_jax.tasks import varchain as vc

    return [vc.VOCAB[w] for w in chain.completion.split()] + [vc.VOCAB[vc.IM_END]]


def heldout_questions() -> set[str]:
    """The packaged held-out questions (a training problem with the same question is skipped)."""
    from vase_jax.tasks.datasets import load_problems

    return {p.question for p in load_problems("varchain")}


def make_batch(cfg: TrainConfig, step: int, skip: set) -> dict[str, np.ndarray]:
    """Batch `step`: tokens, next-token targets and loss weights [batch, T]. Every row of a batch has the same
    number of lines (no padding between rows' lengths); half of the batches draw it from the upper half of the
    curriculum's current range."""
    from vase_jax.tasks import varchain as vc

    rng = np.random.default_rng([TRAIN_STREAM, cfg.seed, step])
    top = cfg.lines_at(step)
    low = 1 if rng.random() < 0.5 else max(1, top // 2)
    lines = int(rng.integers(low, top + 1))
    chains = []
    while len(chains) < cfg.batch:
        chain = vc.problem(int(rng.integers(0, 2**62)), lines, "train")
        if chain.question not in skip:
            chains.append(chain)
    return encode_batch(chains)


def encode_batch(chains) -> dict[str, np.ndarray]:
    """Token ids of prompt + completion per row (right-padded to a multiple of 64), the next-token targets and
    the loss weights (1 on the positions that predict a completion token)."""
    rows = [(prompt_ids(c), completion_ids(c)) for c in chains]
    width = -(-max(len(p) + len(c) for p, c in rows) // 64) * 64
    tokens = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), width), np.float32)
    for r, (p, c) in enumerate(rows):
        tokens[r, :len(p) + len(c)] = p + c
        weights[r, len(p) - 1:len(p) + len(c) - 1] = 1.0  # position t predicts token t + 1
    targets = np.concatenate([tokens[:, 1:], np.zeros((len(rows), 1), np.int32)], axis=1)
    return {"tokens": tokens, "targets": targets, "weights": weights}


def heldout_chains(limit: int | None = None):
    """The packaged held-out problems as `varchain.Chain`s (their seeds and lengths from the JSONL)."""
    from vase_jax.tasks import varchain as vc
    from vase_jax.tasks.datasets import load_problems

    return [vc.problem(int(p.id.split("-")[1]), vc.DEFAULT_STEPS, "heldout")
            for p in load_problems("varchain", limit=limit)]


def heldout_exact(params, graphdef, count: int = 32) -> float:
    """Share of the first `count` packaged held-out problems whose every completion token is the argmax of the
    teacher-forced logits (what greedy decoding with the full cache writes, up to ties)."""
    batch = encode_batch(heldout_chains(count))
    logits = np.asarray(forward_logits(graphdef, params, batch["tokens"]))
    wrong = (logits.argmax(-1) != batch["targets"]) & (batch["weights"] > 0)
    return float((~wrong.any(axis=1)).mean())


def forward_logits(graphdef, params, tokens):
    """The model's float32 logits [batch, T, vocab] over right-padded `tokens` [batch, T] (causal: the padding
    after a row's end is never attended by its real tokens), with the platform's unrolled layer loop."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from vase_jax.target import Target

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    model = nnx.merge(graphdef, params)
    return model.forward(jnp.asarray(tokens), positions, None,
                         target=Target.make(jax.default_backend(), "unroll"))[0]


# ---- model and step -----------------------------------------------------------------------------------------------
def init_model(cfg: TrainConfig):
    import jax.numpy as jnp

    from vase_jax.model import Qwen3
    from vase_jax.random_model import random_params

    mcfg = cfg.model_config()
    return Qwen3.from_params(mcfg, random_params(mcfg, seed=cfg.seed), jnp.float32)


def make_optimizer(cfg: TrainConfig):
    import optax

    warmup = min(cfg.warmup, cfg.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, end_value=cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay))


def make_step(graphdef, optimizer):
    """A jitted (params, opt_state, batch) -> (params, opt_state, loss), the inputs donated."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        logits = forward_logits(graphdef, params, batch["tokens"])  # [batch, T, vocab]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)[..., 0]
        return (nll * batch["weights"]).sum() / batch["weights"].sum()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def init_weights(cfg: TrainConfig, folder: Path, params):
    """The weights of the last checkpoint of the run in `folder` (same model shape as `cfg`)."""
    import jax
    import orbax.checkpoint as ocp

    saved = folder / "train_config.json"
    if not saved.is_file():
        raise ValueError("not a train.py output folder (no train_config.json)")
    other = TrainConfig(**json.loads(saved.read_text()))
    if other.model_config() != cfg.model_config():
        raise ValueError("its model shape differs from this run's")
    manager = _manager(folder)
    step = manager.latest_step()
    if step is None:
        raise ValueError("it holds no checkpoint")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params,
                                                              "opt": make_optimizer(other).init(params)})
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    manager.close()
    return restored["params"]


# ---- checkpoints and logs -------------------------------------------------------------------------------------------
def _manager(out: Path):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(out.resolve() / "checkpoints", options=options)


def _read_log(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row["step"] <= upto:
            rows.append(row)
    return rows


def plot_loss(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    rows = [r for r in rows if "loss" in r]
    steps = np.array([r["step"] for r in rows])
    loss = np.array([r["loss"] for r in rows])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.5, alpha=0.4, label="per step")
    if len(loss) >= 50:
        smooth = np.convolve(loss, np.ones(50) / 50, mode="valid")
        ax.plot(steps[49:], smooth, lw=1.5, label="mean of 50")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per completion token (nats)")
    ax.set_title("varchain training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- accuracy of the exported model ---------------------------------------------------------------------------------
def greedy_accuracy(folder: Path, chains, batch: int = 100) -> float:
    """Share of `chains` the exported model solves with `generate`, full cache, greedy (as `eval.py` runs it)."""
    import jax
    import jax.numpy as jnp

    import vase_jax as vj
    from vase_jax.tasks import varchain as vc

    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    tok = vj.load_tokenizer(str(folder))
    correct = 0
    for i in range(0, len(chains), batch):
        part = chains[i:i + batch]
        enc = vj.encode_prompts(tok, [c.question for c in part])
        out = vj.generate(model, enc.input_ids, enc.attention_mask, key=jax.random.key(0),
                          config=vj.GenerateConfig(max_new_tokens=512 - enc.input_ids.shape[1], temperature=0.0,
                                                   eos_token_ids=(tok.eos_token_id,)))
        tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
        for r, chain in enumerate(part):
            text = tok.decode(tokens[r, :counts[r]].tolist(), skip_special_tokens=True)
            correct += vc.extract_answer(text) == chain.answer
    return correct / len(chains)


# ---- export ---------------------------------------------------------------------------------------------------------
def export(model, cfg: TrainConfig, folder: Path, meta: dict) -> None:
    """Write the Hugging Face folder of `model`: config.json (Qwen3ForCausalLM), model.safetensors (float32),
    generation_config.json, tokenizer.json + tokenizer_config.json (with the chat template), TRAINING.json."""
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    from vase_jax.tasks import varchain as vc
    from vase_jax.weights import flat_params, hf_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    mcfg = model.cfg
    ids = vc.VOCAB
    hf = Qwen3Config(vocab_size=mcfg.vocab_size, hidden_size=mcfg.hidden_size,
                     intermediate_size=mcfg.intermediate_size, num_hidden_layers=mcfg.num_layers,
                     num_attention_heads=mcfg.num_heads, num_key_value_heads=mcfg.num_kv_heads,
                     head_dim=mcfg.head_dim, max_position_embeddings=mcfg.max_position_embeddings,
                     rope_theta=mcfg.rope_theta, rms_norm_eps=mcfg.rms_norm_eps, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_id=ids[vc.IM_END], pad_token_id=ids[vc.PAD],
                     architectures=["Qwen3ForCausalLM"])
    hf.save_pretrained(folder)
    state = hf_state_dict({k: np.asarray(v) for k, v in flat_params(model).items()}, mcfg)
    state.pop("lm_head.weight", None)  # tied: HF reads the embedding
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tok = PreTrainedTokenizerFast(tokenizer_object=vc.build_tokenizer(), eos_token=vc.IM_END,
                                  pad_token=vc.PAD, unk_token=vc.UNK, chat_template=vc.CHAT_TEMPLATE)
    tok.save_pretrained(folder)
    # readable by transformers 4 too: the class name both versions know, and the template inside the config
    config_path = folder / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings |= {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": vc.CHAT_TEMPLATE}
    config_path.write_text(json.dumps(settings, indent=2) + "\n")
    os.chmod(folder / "model.safetensors", 0o644)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids[vc.IM_END], ids[vc.PAD]], "pad_token_id": ids[vc.PAD], "do_sample": False}, indent=2)
        + "\n")
    (folder / "TRAINING.json").write_text(json.dumps(meta, indent=2) + "\n")


# ---- main -----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/train-varchain", help="checkpoints, log.jsonl, loss.png")
    p.add_argument("--export", metavar="DIR", help="after training, write the HF folder here")
    p.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (default 200)")
    p.add_argument("--stop-after", type=int, help="stop (as if killed) once this step is done (tests, split runs)")
    for f in dataclasses.fields(TrainConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    # --init DIR: start from the last checkpoint of the run in DIR (a second stage; recorded in train_config.json)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if cfg.max_lines < 1 or cfg.start_lines < 1 or cfg.max_lines > 57:
        print(f"{PROG}: error: --start-lines/--max-lines must be in [1, 57]", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "train_config.json"
    if saved.exists() and TrainConfig(**json.loads(saved.read_text())) != cfg:
        print(f"{PROG}: error: {out} was trained with other settings ({saved}); use them or a new --out",
              file=sys.stderr)
        return 2
    saved.write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")

    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tqdm import tqdm

    model = init_model(cfg)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(params)
    if cfg.init:
        try:
            params = init_weights(cfg, Path(cfg.init), params)
        except ValueError as e:
            print(f"{PROG}: error: --init {cfg.init}: {e}", file=sys.stderr)
            return 2
        opt_state = optimizer.init(params)
    step_fn = make_step(graphdef, optimizer)
    manager = _manager(out)
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
        restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt"]
    log_path = out / "log.jsonl"
    rows = _read_log(log_path, start)
    log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elapsed = max((r["seconds"] for r in rows if "seconds" in r), default=0.0)
    skip = heldout_questions()
    end = cfg.steps if args.stop_after is None else min(cfg.steps, args.stop_after)
    bar = tqdm(total=cfg.steps, initial=start, unit="step", desc="varchain", dynamic_ncols=True)
    t0 = time.perf_counter()
    with log_path.open("a") as log:
        for step in range(start, end):
            batch = make_batch(cfg, step, skip)
            params, opt_state, loss = step_fn(params, opt_state, batch)
            loss = float(loss)
            now = elapsed + time.perf_counter() - t0
            log.write(json.dumps({"step": step + 1, "loss": loss, "lines": cfg.lines_at(step),
                                  "seconds": round(now, 2)}) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.4f}", lines=cfg.lines_at(step), refresh=False)
            bar.update(1)
            if (step + 1) % args.save_every == 0 or step + 1 == end:
                manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
                manager.wait_until_finished()
                exact = heldout_exact(params, graphdef)
                log.write(json.dumps({"step": step + 1, "heldout_exact": exact}) + "\n")
                log.flush()
                bar.write(f"step {step + 1}: loss {loss:.4f}, held-out exact (teacher-forced, 32) {exact:.3f}")
                plot_loss(_read_log(log_path, step + 1), out / "loss.png")
    bar.close()
    manager.close()
    if args.export and end == cfg.steps:
        rows = _read_log(log_path, end)
        losses = [r for r in rows if "loss" in r]
        meta = {"config": dataclasses.asdict(cfg), "steps": end,
                "seconds": losses[-1]["seconds"] if losses else None,
                "final_loss_mean_of_50": float(np.mean([r["loss"] for r in losses[-50:]])) if losses else None}
        export(nnx.merge(graphdef, params), cfg, Path(args.export), meta)
        from vase_jax.tasks import varchain as vc

        heldout = heldout_chains()
        fresh = [vc.problem(seed, vc.DEFAULT_STEPS, "fresh") for seed in range(200)]
        if cfg.init:  # a second stage: what the first one was, and the time of both
            first = json.loads((Path(cfg.init) / "train_config.json").read_text())
            first_rows = [r for r in _read_log(Path(cfg.init) / "log.jsonl", first["steps"]) if "loss" in r]
            meta["init"] = {"config": first, "steps": len(first_rows),
                            "seconds": first_rows[-1]["seconds"] if first_rows else None}
            meta["seconds_total"] = (meta["seconds"] or 0.0) + (meta["init"]["seconds"] or 0.0)
        meta |= {"heldout_accuracy": greedy_accuracy(Path(args.export), heldout),
                 "fresh_accuracy": greedy_accuracy(Path(args.export), fresh),
                 "accuracy": f"full cache, greedy, {vc.DEFAULT_STEPS}-line problems: the 200 packaged held-out "
                             "ones and 200 of the 'fresh' seed stream (seeds 0-199), graded exactly"}
        (Path(args.export) / "TRAINING.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(f"{PROG}: wrote {args.export} (held-out accuracy {meta['heldout_accuracy']:.3f}, fresh "
              f"{meta['fresh_accuracy']:.3f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
