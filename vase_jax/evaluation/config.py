"""`EvalConfig`: one evaluation run's settings, resolved from the task's paper defaults, validated up front.

Everything that can be checked without the model is checked here, so that a bad flag fails in a second, not
after loading weights and compiling. `RESULT_FIELDS` are the settings that change a sample's tokens or grade;
a run directory written under other values of them is refused (`check_resume`), the others (methods, budgets,
samples, limit) only select which records a run asks for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
from pathlib import Path

from vase_jax.eviction import METHODS
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.triattention import calibrate_command, stats_path
from vase_jax.generate import MIN_PREFILL_CHUNK, GenerateConfig
from vase_jax.kvquant import BF16, KVBits, kv_name
from vase_jax.random_model import RANDOM_MODELS
from vase_jax.tasks import Problem, Task, get_task, load_problems
from vase_jax.tasks.livecodebench import packaged_prompts
from vase_jax.tasks.registry import suggest
from vase_jax.tiers import tier_layout
from vase_jax.weights import ORBAX_MARKER

RANDOM_PREFIX = "random:"
DTYPES = ("bfloat16", "float32")
SCHEDULERS = ("continuous", "static")
AUTO = "auto"  # --batch-size: the most rows the device fits, per (method, budget) (`vase_jax.planner`)
RESULT_FIELDS = ("model", "task", "data_sha256", "buffer", "value_slots", "max_new_tokens",
                 "max_total_tokens", "temperature", "top_p", "top_k", "batch_size", "seed", "dtype", "kv_protected",
                 "calibration_sha256", "compress_prompt", "prefill_chunk")
# What a config.json written before a field existed ran with (the dense prefill, the whole prompt kept)
FIELD_DEFAULTS = {"compress_prompt": False, "prefill_chunk": None}
# Result fields of some methods only (TriAttention's statistics): compared when both runs set them, and kept in
# config.json by a later run that does not (so that a run of other methods can resume the folder).
METHOD_FIELDS = ("calibration_sha256",)
FORMAT = 1  # bump when the records' meaning changes


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """A fully resolved run. `budgets` apply to every evicting method; `full` runs once (budget None)."""

    model: str  # hub id, absolute local folder, or "random:<name>"
    task: str
    data: str | None  # user data file (None: the packaged set)
    tests_dir: str | None  # livecodebench: the folder of the authors' test files (None: tests in --data)
    data_sha256: str  # of the data file's bytes: a changed file is a different run
    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    buffer: int
    value_slots: int | None  # None: N / 4 for each budget N (the paper's Nv)
    samples: int  # R per problem
    max_new_tokens: int | None  # None: the task's total cap minus each prompt (see `token_limits`)
    max_total_tokens: int  # prompt + output cap when max_new_tokens is None
    temperature: float
    top_p: float
    top_k: int
    batch_size: int | str  # rows of the batch (continuous) or per generate call (static: samples of one
    # problem); "auto" (continuous): the most rows that fit the device, per (method, budget)
    limit: int | None
    seed: int
    dtype: str
    save_text: bool = False
    scheduler: str = "continuous"  # "continuous" or "static"; the tokens are the same under both
    # Cache settings (`kvquant.KVBits` names: "K16V16" is the 16-bit cache, "K8V4" a mixed-precision one), each
    # a variant of every (method, budget); and the 16-bit slots of a mixed-precision cache (None: the default).
    kv_bits: tuple[str, ...] = (BF16,)
    kv_protected: int | None = None
    kv_methods: tuple[str, ...] | None = None  # the methods run with the mixed-precision settings (None: all)
    eos_token_ids: tuple[int, ...] | None = None  # the model's end tokens (`runner.end_tokens`; None: Qwen3's)
    # TriAttention's query statistics (a file; None when no method takes a calibration) and its bytes' digest
    calibration: str | None = None
    calibration_sha256: str = ""
    # `EvictionConfig.compress_prompt` for every evicting method; `GenerateConfig.prefill_chunk` (None: dense)
    compress_prompt: bool = False
    prefill_chunk: int | None = GenerateConfig.prefill_chunk
    format: int = FORMAT

    @property
    def variants(self) -> tuple[tuple[str, int | None, str], ...]:
        """(method, budget, kv_bits) in run order; `full` once per cache setting with budget None. A
        mixed-precision setting runs the methods of `kv_methods` only (all when None)."""
        out: list[tuple[str, int | None, str]] = []
        for kv in self.kv_bits:
            for m in self.methods:
                if kv != BF16 and self.kv_methods is not None and m not in self.kv_methods:
                    continue
                out.extend([(m, None, kv)] if m == "full" else [(m, b, kv) for b in self.budgets])
        return tuple(out)

    @property
    def rows(self) -> int:
        """Rows per generate call: min(batch_size, R). A short last chunk is padded to this many rows."""
        return min(self.batch_size, self.samples)

    def eviction(self, method: str, budget: int | None) -> EvictionConfig:
        if method == "full":
            return EvictionConfig("full")
        own = {"calibration": self.calibration} if "calibration" in METHODS[method].option_names else {}
        return EvictionConfig(method, budget=budget, buffer=self.buffer, value_slots=self.value_slots,
                              compress_prompt=self.compress_prompt, **own)

    def generate_config(self, max_new_tokens: int, kv_bits: str = BF16) -> GenerateConfig:
        kv = KVBits.parse(kv_bits)
        quantized = dict(key_bits=kv.key_bits, value_bits=kv.value_bits, kv_group=kv.key_group,
                         kv_protected=self.kv_protected, kv_refine=kv.refine) if kv.quantizes else {}
        ends = {} if self.eos_token_ids is None else {"eos_token_ids": tuple(self.eos_token_ids)}
        return GenerateConfig(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, prefill_chunk=self.prefill_chunk, **quantized, **ends)

    def token_limits(self, prompt_len: int) -> tuple[int, int]:
        """(max_new_tokens passed to `generate`, exact output cap recorded) for a `prompt_len`-token prompt.

        With `--max-new-tokens M` both are M. Otherwise the reference caps prompt + output at
        `max_total_tokens` (exact cap: total - prompt_len). `generate` compiles one program per
        max_new_tokens, so we pass the largest exact cap of the prompt's bucket, total - (previous
        bucket + 1), which depends only on the bucket; outputs are then cut at the exact cap when recorded
        (and counted as truncated if they had not ended by then).
        """
        if self.max_new_tokens is not None:
            return self.max_new_tokens, self.max_new_tokens
        buckets = GenerateConfig().prompt_buckets
        bucket = GenerateConfig().bucket(prompt_len)
        if bucket in buckets:  # prompts in (previous bucket, bucket] share one program
            i = buckets.index(bucket)
            floor = buckets[i - 1] if i else 0
        else:  # beyond the last bucket generate pads to multiples of 8192
            floor = bucket - 8192
        exact = max(1, self.max_total_tokens - prompt_len)
        return max(exact, self.max_total_tokens - floor - 1), exact

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _positive(name: str, value, allow_none: bool = False, minimum: int = 1):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"--{name}={value!r} must be an integer >= {minimum}")


def data_sha256(task: Task, data: str | None) -> str:
    """sha256 of the task's data file (the user's, or the packaged one; LiveCodeBench: the packaged prompts,
    whose md5 column pins the content of the test files)."""
    if data is not None:
        h = hashlib.sha256()
        with open(data, "rb") as fh:  # a LiveCodeBench release file can be gigabytes
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    if task.grader == "code":
        return hashlib.sha256(packaged_prompts().read_bytes()).hexdigest()
    res = importlib.resources.files("vase_jax").joinpath("data", "tasks", task.data_dir, "test.jsonl")
    return hashlib.sha256(res.read_bytes()).hexdigest()


def packaged_model_dir() -> Path:
    """The trained model shipped with the package (`scripts/train.py`'s output; its task is `varchain`)."""
    return Path(str(importlib.resources.files("vase_jax") / "data" / "models" / "varchain-qwen3"))


def check_model(model: str) -> str:
    """Validate a --model value without loading it; return it normalized (local folders made absolute).

    A local folder needs config.json and weights (*.safetensors, a safetensors index, or an orbax `params`
    folder). Anything else must look like a hub id 'org/name' (downloaded later).
    """
    if model.startswith(RANDOM_PREFIX):
        name = model[len(RANDOM_PREFIX):]
        if name not in RANDOM_MODELS:
            raise ValueError(f"--random-model={name!r} is not known; known: {', '.join(RANDOM_MODELS)}")
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model={model!r}: folder has no config.json")
        has_weights = (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
                       or ((path / ORBAX_MARKER).is_file() and (path / "params").is_dir()))
        if not has_weights:
            raise ValueError(f"--model={model!r}: folder has no weights (*.safetensors or orbax params/)")
        return str(path.resolve())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"--model={model!r} is not an existing folder and not a hub id 'org/name'")
    return model


def resolve(
    *, model: str, task: str, data: str | None = None, methods: tuple[str, ...] = ("full",),
    budgets: tuple[int, ...] | None = None, buffer: int | None = None, value_slots: int | None = None,
    samples: int | None = None, max_new_tokens: int | None = None, max_total_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None, top_k: int | None = None, batch_size: int | None = None,
    limit: int | None = None, seed: int | None = None, dtype: str = "bfloat16", save_text: bool = False,
    tests_dir: str | None = None, scheduler: str = "continuous", kv_bits: tuple[str, ...] = (BF16,),
    kv_protected: int | None = None, kv_methods: tuple[str, ...] | None = None, calibration: str | None = None,
    compress_prompt: bool = False, prefill_chunk: int | None = GenerateConfig.prefill_chunk,
) -> tuple[EvalConfig, list[Problem]]:
    """Fill defaults from the task (paper settings), validate every field, read the problems.

    Raises ValueError with a one-line message naming the flag and its value.
    """
    t = get_task(task)
    if not methods:
        raise ValueError("--methods is empty; pass a comma list such as full,vase_attnv")
    for flag, names in (("--methods", methods), ("--kv-methods", kv_methods or ())):
        for m in names:
            if m not in METHODS and m != "full":
                raise ValueError(f"{flag}: {m!r} is not a known method{suggest(m, ['full', *METHODS])}; known: "
                                 f"full, {', '.join(sorted(METHODS))}")
    methods = tuple(dict.fromkeys(methods))
    kv_methods = None if kv_methods is None else tuple(dict.fromkeys(kv_methods))
    budgets = tuple(dict.fromkeys(budgets)) if budgets else t.budgets
    buffer = t.buffer if buffer is None else buffer
    for b in budgets:
        _positive("budgets", b)
    if scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler={scheduler!r}; allowed: {', '.join(SCHEDULERS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    _positive("buffer", buffer)
    _positive("value-slots", value_slots, allow_none=True, minimum=0)
    _positive("samples", samples, allow_none=True)
    _positive("max-new-tokens", max_new_tokens, allow_none=True)
    _positive("max-total-tokens", max_total_tokens, allow_none=True)
    if batch_size == AUTO:
        if scheduler != "continuous":
            raise ValueError("--batch-size auto sizes the continuous engine's batch; with --scheduler static give "
                             "a number")
    else:
        _positive("batch-size", batch_size, allow_none=True)
    _positive("limit", limit, allow_none=True, minimum=0)
    _positive("kv-protected", kv_protected, allow_none=True, minimum=0)
    kv_bits = tuple(dict.fromkeys(kv_name(k) for k in (kv_bits or (BF16,))))
    if any(kv != BF16 for kv in kv_bits):
        # a method whose kept set is shared over layers (triattention) does not run on the mixed-precision cache:
        # left out of the default, refused when named
        def tiered(m: str) -> bool:
            return m == "full" or METHODS[m].mixed_precision

        if kv_methods is None:
            kept = tuple(m for m in methods if tiered(m))
            kv_methods = None if kept == methods else kept
        refused = [m for m in kv_methods or () if not tiered(m)]
        if refused:
            able = ", ".join(n for n in ("full", *sorted(METHODS)) if tiered(n))
            raise ValueError(f"--kv-methods: {refused[0]!r} does not run on the mixed-precision cache of --kv-bits "
                             f"{','.join(k for k in kv_bits if k != BF16)}; methods that do: {able}")
    _positive("seed", seed, allow_none=True, minimum=0)
    try:
        GenerateConfig(prefill_chunk=prefill_chunk).validate()
    except ValueError:
        raise ValueError(f"--prefill-chunk={prefill_chunk!r}; allowed: 0 (the dense prefill) or an int >= "
                         f"{MIN_PREFILL_CHUNK}") from None
    if compress_prompt and any(kv != BF16 for kv in kv_bits):
        raise ValueError(f"--compress-prompt runs on the 16-bit cache; --kv-bits {','.join(kv_bits)} asks for a "
                         "mixed-precision one: drop one of the two")
    samples = samples or t.samples
    if data is not None and not os.path.isfile(data):
        raise ValueError(f"--data={data!r} is not an existing file")
    if tests_dir is not None and t.grader != "code":
        raise ValueError(f"--tests-dir is only for --task livecodebench, not {t.name}")
    if tests_dir is not None and not os.path.isdir(tests_dir):
        raise ValueError(f"--tests-dir={tests_dir!r} is not an existing folder")
    if t.grader == "code" and data is None and tests_dir is None:
        raise ValueError(f"--task {t.name} needs its test cases: pass --data RELEASE.jsonl (the official "
                         "release file) or --tests-dir DIR (the authors' test files; prompts packaged)")
    if data is None and t.data_dir is None and t.grader != "code":
        raise ValueError(f"--task {t.name} has no packaged data; pass --data FILE.jsonl "
                         "(format: vase_jax/data/tasks/README.md)")
    model = check_model(model)
    calibration = _calibration(model, methods, calibration)
    cfg = EvalConfig(
        model=model, task=t.name, data=str(Path(data).resolve()) if data else None,
        tests_dir=str(Path(tests_dir).resolve()) if tests_dir else None, data_sha256="", methods=methods,
        budgets=budgets, buffer=buffer, value_slots=value_slots,
        samples=samples, max_new_tokens=max_new_tokens,
        max_total_tokens=max_total_tokens or t.max_total_tokens,
        temperature=t.temperature if temperature is None else float(temperature),
        top_p=t.top_p if top_p is None else float(top_p), top_k=t.top_k if top_k is None else top_k,
        batch_size=batch_size or t.batch_size or samples, limit=t.num_problems if limit is None else limit,
        seed=t.seed if seed is None else seed, dtype=dtype, save_text=save_text, scheduler=scheduler,
        kv_bits=kv_bits, kv_protected=kv_protected, kv_methods=kv_methods, calibration=calibration,
        calibration_sha256=hashlib.sha256(Path(calibration).read_bytes()).hexdigest() if calibration else "",
        compress_prompt=bool(compress_prompt), prefill_chunk=prefill_chunk,
    )
    try:
        cfg.generate_config(cfg.max_new_tokens or 1).validate()
    except ValueError as e:
        raise ValueError(f"sampling flags: {e}") from None
    for method, budget, kv in cfg.variants:
        try:
            eviction = cfg.eviction(method, budget).validate()
            if KVBits.parse(kv).quantizes:  # the tiers' own checks (the head's size is checked at generate)
                tier_layout(KVBits.parse(kv), kv_protected, eviction, 64, cfg.max_new_tokens or 64)
        except ValueError as e:
            where = f"--methods {method} --budgets {budget}" + (f" --kv-bits {kv}" if kv != BF16 else "")
            raise ValueError(f"{where}: {e}".replace("GenerateConfig.kv_protected", "--kv-protected")) from None
    try:
        problems = load_problems(t, data, cfg.limit, tests_dir=tests_dir)
    except ValueError as e:
        raise ValueError(f"--data: {e}" if data else str(e)) from None
    if not problems:
        raise ValueError(f"--limit={limit}: no problems to evaluate")
    return dataclasses.replace(cfg, data_sha256=data_sha256(t, data)), problems


def _calibration(model: str, methods: tuple[str, ...], given: str | None) -> str | None:
    """The statistics file of the methods that take a calibration (TriAttention): --calibration, else the one in
    the model's folder; None when no method takes one. ValueError naming the flag and the command that makes it."""
    takers = [m for m in methods if m != "full" and "calibration" in METHODS[m].option_names]
    if not takers:
        if given is not None:
            raise ValueError("--calibration is for --methods triattention")
        return None
    if given is None and (model.startswith(RANDOM_PREFIX) or not os.path.isdir(model)):
        raise ValueError(f"--methods {','.join(takers)} with --model {model}: pass --calibration FILE (make it with "
                         f"`{calibrate_command('FOLDER')} --text TEXT --out FILE` on the model's checkpoint folder)")
    path = stats_path(given or model)
    if not os.path.isfile(path):
        raise ValueError(f"--methods {','.join(takers)}: no calibration at {path}; make it with "
                         f"`{calibrate_command(model if given is None else 'FOLDER')}`"
                         + ("" if given is None else " --out " + path))
    return path


def check_resume(cfg: EvalConfig, out_dir: Path) -> None:
    """Refuse an output folder written under settings that change results; name the first differing field."""
    saved_file = out_dir / "config.json"
    records = out_dir / "records.jsonl"
    if saved_file.exists() and (not records.exists() or records.stat().st_size == 0):
        return  # a run that stopped before its first record (a model that did not load) binds nothing
    if not saved_file.exists():
        if (out_dir / "records.jsonl").exists():
            raise ValueError(f"{out_dir}: records.jsonl without config.json; use a new --out")
        return
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{saved_file}: unreadable ({e}); use a new --out") from None
    now = cfg.to_json()
    for field in ("format", *RESULT_FIELDS):
        if field in METHOD_FIELDS and not (saved.get(field) and now[field]):
            continue
        if saved.get(field, FIELD_DEFAULTS.get(field)) != now[field]:
            raise ValueError(
                f"--out {out_dir} was run with {field}={saved.get(field, FIELD_DEFAULTS.get(field))!r}, now "
                f"{field}={now[field]!r}; "
                "that changes results: use the same settings or a new --out"
            )


def write_config(cfg: EvalConfig, out_dir: Path) -> None:
    """Atomically write `out_dir/config.json` (the latest invocation; result fields never change)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = cfg.to_json()
    try:
        saved = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        saved = {}
    fields |= {f: saved[f] for f in METHOD_FIELDS if not fields[f] and saved.get(f)}
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(fields, indent=2) + "\n")
    os.replace(tmp, out_dir / "config.json")
