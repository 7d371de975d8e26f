"""Weights that are NaN or infinite refuse the load in one line: the file, the converted copy, a safetensors folder.

Trial 14d: a GGUF file with 64 KiB of 0xFF written over its middle loaded and generated an empty
completion (uniform logits, token 0) with exit status 0. These tests break tiny synthetic GGUF
files (tests/gguf_helpers.py) the same way.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanovllm_core.model import loader
from nanovllm_core.model.loader import GGUF_BLOCKS_FILE, ModelLoadError, load_model
from nanovllm_core.model.weight_checks import nonfinite_floats, nonfinite_scales
from tests.conftest import run_main, save_tiny_llama
from tests.gguf_helpers import overwrite_tensor, tokenizer_fields, write_tiny_gguf


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_fields(loader.default_gguf_path())


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The converted copies go to a fresh cache under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nanovllm" / "gguf"


def load(path, quantization=None):
    return load_model(str(path), torch.device("cpu"), torch.float32, quantization=quantization)


def refusal(path, quantization=None) -> str:
    with pytest.raises(ModelLoadError) as e:
        load(path, quantization)
    message = str(e.value)
    assert "\n" not in message
    return message


def damage_safetensors(file, name: str, damage) -> None:
    """Rewrite one tensor of a safetensors file with ``damage(tensor)`` applied, metadata kept."""
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    damage(tensors[name])
    save_file(tensors, str(file), metadata=metadata)


@pytest.mark.parametrize("tensor, data", [
    ("blk.1.ffn_down.weight", b"\xff" * 64),  # a Q4_1 block's scale and min become NaN (the trial's 0xFF bytes)
    ("blk.0.ffn_norm.weight", np.float32(np.inf).tobytes()),  # a float32 norm weight becomes inf
], ids=["q4_1-scale", "f32-norm"])
def test_a_gguf_file_with_non_finite_weights_is_refused_naming_the_tensor(tokenizer, cache, tmp_path, tensor, data):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    overwrite_tensor(path, tensor, data)
    message = refusal(path)
    assert message.startswith(f"tiny.gguf is corrupt: tensor {tensor} holds ")
    assert "NaN or infinite" in message and "re-download it" in message
    assert not list(cache.glob("*/model.safetensors"))  # nothing of it is kept to be trusted next time


def test_the_cli_refuses_a_corrupt_gguf_with_one_line_and_status_2(tokenizer, cache, tmp_path, capsys):
    from nanovllm_core.cli import main

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    overwrite_tensor(path, "blk.0.attn_q.weight", b"\xff" * 4)
    code, out, err = run_main(main, capsys, "--model", str(path), "--max-tokens", "4")
    assert code == 2 and "Completion" not in out
    assert "tiny.gguf is corrupt: tensor blk.0.attn_q.weight" in err.splitlines()[-1]


@pytest.mark.parametrize("quantization, damaged", [("none", "model.safetensors"), (None, GGUF_BLOCKS_FILE)])
def test_a_corrupt_converted_copy_is_refused_with_the_folder_to_delete(tokenizer, cache, tmp_path, quantization,
                                                                       damaged):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    folder = load(path, quantization)[2].path  # converted once (auto also keeps the file's blocks there)
    name = "model.layers.1.mlp.down_proj.weight"
    if damaged == GGUF_BLOCKS_FILE:
        damage_safetensors(folder / damaged, name, lambda blocks: blocks[0, 0:2].fill_(0xFF))  # block 0's scale: NaN
    else:
        damage_safetensors(folder / damaged, name, lambda w: w[3, 5].fill_(float("nan")))
    message = refusal(path, quantization)
    assert message.startswith(f"tensor {name} in {damaged} ")
    assert message.endswith(f": the checkpoint is corrupt; delete the folder {folder} (this engine's converted copy "
                            "of tiny.gguf) and run again to convert it anew")
    shutil.rmtree(folder)  # as the line says: the next run converts the (sound) file again
    assert load(path, quantization)[0] is not None


def test_a_gguf_file_damaged_after_its_conversion_is_refused_when_its_blocks_are_read(tokenizer, cache, tmp_path,
                                                                                     monkeypatch):
    """The conversion is reused while the file's size, time and header are unchanged: damage past the
    header of a large file whose time was kept is caught where the blocks are read from the file.
    (The tiny file is all header, so only its first 64 bytes are hashed here.)"""
    import os

    from nanovllm_core.model import loader

    monkeypatch.setattr(loader, "HEADER_BYTES", 64)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    load(path, "none")  # converted while sound: float weights, no blocks kept yet
    before = os.stat(path)
    overwrite_tensor(path, "blk.1.attn_v.weight", b"\x00\x7c")  # block 0's scale: fp16 +inf; the size is unchanged
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    message = refusal(path, "gguf")  # the same converted folder, but the blocks come from the file
    assert message.startswith("tiny.gguf is corrupt: tensor blk.1.attn_v.weight has 1 q4_1 block whose scale is NaN")
    assert message.count("tiny.gguf") == 1 and "re-download it" in message


def test_a_gguf_file_damaged_after_its_conversion_is_converted_afresh_and_refused(tokenizer, cache, tmp_path):
    """Trial 18b: a file changed at the same path is not run from the old conversion."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    load(path, "none")
    overwrite_tensor(path, "blk.1.attn_v.weight", b"\x00\x7c")
    message = refusal(path, "none")
    assert message.startswith("tiny.gguf is corrupt: tensor blk.1.attn_v.weight holds 32 values that are NaN or infinite")
    assert message.count("tiny.gguf") == 1 and "re-download it" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_safetensors_checkpoint_with_a_nan_weight_is_refused(tmp_path, default_model_dir, dtype):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k).to(dtype) for k in f.keys()}
    tensors[name][7, 1] = float("-inf")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), torch.device("cpu"), torch.float32)
    assert str(e.value) == (f"tensor {name} in model.safetensors holds 1 value that is NaN or infinite: the "
                            f"checkpoint is corrupt; re-download the model in {path} (or convert it again)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_non_finite_floats_are_counted_in_every_float_dtype(dtype):
    t = torch.zeros(4, 8, dtype=dtype)
    assert nonfinite_floats(t) == 0
    t[0, 1], t[2, 3], t[3, 7] = float("nan"), float("inf"), float("-inf")
    assert nonfinite_floats(t) == 3
    assert nonfinite_floats(torch.arange(5)) == 0  # an integer tensor holds no NaN


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_block_with_a_non_finite_scale_is_counted_once(fmt):
    from nanovllm_core.model.block_quant import FORMATS, quantize

    blocks = quantize(torch.randn(4, 64), fmt)
    assert nonfinite_scales(blocks, fmt) == 0
    size = FORMATS[fmt].block_bytes
    blocks[1, size:size + 2] = torch.tensor([0x00, 0xFC], dtype=torch.uint8)  # row 1, block 1: d = -inf
    blocks[2, 0:2] = 0xFF  # row 2, block 0: d = NaN
    if fmt == "q4_1":
        blocks[2, 2:4] = 0xFF  # the same block's min too: still one block
        blocks[3, 2:4] = 0xFF  # row 3, block 0: only m = NaN
    assert nonfinite_scales(blocks, fmt) == (3 if fmt == "q4_1" else 2)
