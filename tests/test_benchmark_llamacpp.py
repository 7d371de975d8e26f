"""The llama.cpp baseline's set-up, without llama-cpp-python: a stand-in module records what
``benchmarks.common.llamacpp_model`` asks of it.

On an AMX CPU the AMX repack must be off for that one load (llama-cpp-python 0.3.36
segfaults in it here, ggml-org/llama.cpp#20824), and llama-cpp-python's own defaults must be
back in place afterwards; elsewhere nothing is changed.
"""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks import common


class _Params:
    use_extra_bufts = True


def _fake_llama_cpp(monkeypatch) -> list[dict]:
    """Install a stand-in ``llama_cpp`` package; returns the list each ``Llama(...)`` call appends to."""
    seen: list[dict] = []
    low_level = types.ModuleType("llama_cpp.llama_cpp")
    low_level.llama_model_default_params = lambda: _Params()

    class Llama:
        def __init__(self, **kwargs):
            # llama-cpp-python builds its model params from the low-level default, as here
            seen.append({"use_extra_bufts": low_level.llama_model_default_params().use_extra_bufts, **kwargs})

    package = types.ModuleType("llama_cpp")
    package.llama_cpp = low_level
    package.Llama = Llama
    package.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", low_level)
    monkeypatch.setattr("nanovllm_core.model.loader.default_gguf_path", lambda: "/models/smollm2.Q4_1.gguf")
    return seen


@pytest.mark.parametrize("flags, repack", [(["avx2", "avx512f", "amx_int8"], False), (["avx2"], True)])
def test_amx_repack_is_off_only_on_amx_cpus_and_only_for_that_load(monkeypatch, flags, repack):
    seen = _fake_llama_cpp(monkeypatch)
    monkeypatch.setattr(common, "cpu_flags", lambda: flags)
    common.llamacpp_model(n_ctx=300, threads=2)
    assert seen == [{"use_extra_bufts": repack, "model_path": "/models/smollm2.Q4_1.gguf", "n_ctx": 300,
                     "n_threads": 2, "n_threads_batch": 2, "verbose": False}]
    import llama_cpp.llama_cpp as low_level

    assert low_level.llama_model_default_params().use_extra_bufts is True  # the library's default is back
    notes = common.llamacpp_notes()
    assert notes["llama_cpp_python"] == "0.0-test"
    assert notes["amx_repack"].startswith("off") is (not repack)
    assert notes["amx_repack"].startswith("not applicable") is repack  # no AMX: nothing to repack for it


def test_the_default_is_restored_when_loading_fails(monkeypatch):
    _fake_llama_cpp(monkeypatch)
    monkeypatch.setattr(common, "cpu_flags", lambda: ["amx_int8"])
    import llama_cpp

    def broken(**kwargs):
        raise ValueError("Failed to load model from file")

    monkeypatch.setattr(llama_cpp, "Llama", broken)
    with pytest.raises(ValueError, match="Failed to load"):
        common.llamacpp_model(n_ctx=64)
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True
