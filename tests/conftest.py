"""Shared fixtures (tiny random HF Qwen3 checkpoints saved with `save_pretrained`, the real Qwen3 tokenizer), each
test's kind, and the order in which the files run.

Kinds (markers, beside `slow`): `unit` (a function against its reference; no model program), `program` (compiles
and runs the model, `generate`, the engine or a kernel inside them), `script` (runs a script or another Python
process), `aot` (compiled for a GPU or TPU that is not attached). A test marked with a kind keeps it; the others
take their file's (`FILE_KINDS`). `pytest -m unit` is the quick check; `pytest -m "not script"` leaves out the
scripts and processes.

Order: the suite runs with `--dist loadfile` (pyproject): each file on one worker, so a module's fixtures (models,
checkpoints, compiled programs) are built once, not once per worker. The files go out heaviest first
(`HEAVIEST_FIRST`, from the suite's profile of test-seconds per file), so that the last files to finish are short.
"""

from __future__ import annotations

import os

# LLVM at -O1 (XLA's default: -O2) for every program the suite compiles, its scripts' and processes' included (they
# inherit the flags; a multi-device one appends its device count). It changes no HLO pass, so the programs the tests
# inspect (copies, temporaries, fusions) are XLA's defaults, and no number: without fast-math both levels emit the
# same IEEE operations (test_jit.py::test_llvm_level_1_gives_the_numbers_of_level_2 checks it bit for bit on every
# machine). Compiling is most of the suite's time, and -O1 compiles `generate` about 15% faster.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch (the HF references) computes on one thread: its OpenMP threads spin while they wait, and beside the other
# xdist worker on two cores the packaged model's four greedy HF generations took 43 s against 3.7 s on one thread
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from vase_jax.jit import enable_compilation_cache, sources_digest  # noqa: E402

# One persistent compilation cache for the whole suite, shared by the xdist workers (and kept between runs of the
# same sources): a program that one worker compiled, or that the mapping guard below released, is loaded. Its folder
# is named by the sources' digest: JAX's cache key leaves out the programs' metadata (names of scopes), which some
# tests read, so a program compiled by other code must not be loaded.
TEST_CACHE = os.environ.get("VASE_JAX_TEST_COMPILATION_CACHE", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "xla-tests", sources_digest()[:16]))
enable_compilation_cache(TEST_CACHE, min_compile_seconds=0.2)
os.environ.setdefault("VASE_JAX_COMPILATION_CACHE", TEST_CACHE)  # scripts run by the tests use it too


KINDS = ("unit", "program", "script", "aot")
FILE_KINDS = {
    "unit": ("test_cli", "test_tasks", "test_sandbox", "test_livecodebench", "test_eviction_methods",
             "test_eviction_scores", "test_kernels", "test_quant_kernels", "test_kvquant", "test_analysis",
             "test_readme"),
    "program": ("test_model", "test_generate", "test_batching", "test_tiers", "test_sharding", "test_layers",
                "test_lowering", "test_weight_copies", "test_invariance", "test_kernels_generate", "test_replay",
                "test_triattention", "test_eviction_framework", "test_jit", "test_weights", "test_kv_error",
                "test_planner", "test_policies", "test_varchain", "test_chunked_prefill"),
    "script": ("test_eval", "test_bench", "test_bench_kernels", "test_device_check", "test_demo_scripts",
               "test_distributed"),
    "aot": ("test_aot", "test_aot_kernels"),
}
# test-seconds per file in a profile of the whole suite (2 workers, cold compilation cache), largest first; files
# not named here follow, in their usual order
HEAVIEST_FIRST = ("test_sharding", "test_eval", "test_varchain", "test_bench", "test_eviction_framework",
                  "test_distributed", "test_layers", "test_tiers", "test_batching", "test_invariance",
                  "test_kernels", "test_generate", "test_kvquant", "test_analysis", "test_replay",
                  "test_kernels_generate", "test_device_check", "test_quant_kernels", "test_sandbox",
                  "test_lowering", "test_planner")


def _file_kind(name: str) -> str | None:
    return next((kind for kind, names in FILE_KINDS.items() if name in names), None)


def pytest_collection_modifyitems(config, items):
    """Each test's kind (its own marker, else its file's) and the files' order (heaviest first; a file's tests
    keep their order)."""
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            kind = _file_kind(item.path.stem)
            if kind is None:
                raise pytest.UsageError(f"{item.path.name}: give the file a kind in conftest.FILE_KINDS")
            item.add_marker(kind)
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path.stem, i)
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), first_seen[item.path.stem]))


def hf_tiny_config(**overrides):
    """The HF config of `vase_jax.random_model.TINY` (the one tiny shape), with `overrides` of HF fields."""
    from transformers import Qwen3Config

    from vase_jax.random_model import TINY

    kw = dict(vocab_size=TINY.vocab_size, hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
              num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
              num_key_value_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
              tie_word_embeddings=TINY.tie_word_embeddings, rope_theta=TINY.rope_theta,
              max_position_embeddings=8192, rms_norm_eps=TINY.rms_norm_eps)
    return Qwen3Config(**(kw | overrides))


def save_tiny_checkpoint(folder, seed: int = 0, dtype: str = "float32", init_std: float = 0.02, **overrides):
    """Random-init `Qwen3ForCausalLM`, saved with `save_pretrained`; returns (folder, hf_model)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(hf_tiny_config(initializer_range=init_std, **overrides)).eval()
    hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(folder)
    return folder, hf


def load_script(name: str, register: bool = False):
    """scripts/<name>.py imported as a module, to call its `main(argv)` in-process. `register`: also put it in
    `sys.modules` (a script whose dataclasses look their module up)."""
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(root, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    """2 layers, 4 query / 2 kv heads (GQA group 2), untied head."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied"))


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    """3 layers, 8 query / 2 kv heads (GQA group 4), tied embeddings."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), seed=1, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tokenizer():
    import vase_jax as vj

    return vj.load_tokenizer()


PROMPTS = [
    "What is 2 + 2? Answer briefly.",
    "Write a haiku about the sea.",
    "Explain, step by step and in detail, why the sum of the angles of a triangle is 180 degrees in the plane.",
]


@pytest.fixture(scope="session")
def prompt_batch(tokenizer):
    import vase_jax as vj

    return vj.encode_prompts(tokenizer, PROMPTS)


@pytest.fixture
def no_persistent_cache():
    """The suite's persistent compilation cache, off for a test (and back on after it): a program compiled for a
    device that is not attached (the `aot` tests) cannot be loaded from it."""
    import jax

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After each test, the mapping-limit guard (`vase_jax.jit`): clear JAX's caches once the worker holds half the
    memory mappings Linux allows. Without it a worker crashed inside XLA at 65530 mappings, about 110 cached
    programs in."""
    yield
    import warnings

    from vase_jax.jit import release_programs_near_mapping_limit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        release_programs_near_mapping_limit()
