"""Newcomer trial 12b's app findings: the ready toast names the weight format as the header does."""

from __future__ import annotations

import pytest

from nanovllm_core import events as ev
from tests.tui_helpers import Notes, tiny_app, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.parametrize("info, shown", [
    ({"quantization": "gguf", "weight_kinds": "q4_1+q8_0"}, "is ready on cpu (float32 · q4_1+q8_0 gguf)"),
    ({"quantization": "q8_0", "weight_kinds": "q8_0"}, "is ready on cpu (float32 · q8_0 weights)"),
    ({}, "is ready on cpu (float32)"),
])
async def test_the_ready_toast_names_the_weight_format_as_the_header_does(tiny_llama_dir, tmp_path, info, shown):
    """Trial 12b: "SmolLM2-135M-Instruct is ready on cpu (float32)" while Q4_1/Q8_0 GGUF blocks ran
    (the header beside it said "float32 · q4_1+q8_0 gguf"); the local and the attached app alike
    announce the engine's ready event so."""
    notes = Notes()
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        app._announce(ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_name="M", device="cpu",
                                      dtype="float32", model_info=tuple(info.items())))
        await pilot.pause(0.1)
        assert notes.find(f"M {shown}"), [n.message for n in notes.items]
