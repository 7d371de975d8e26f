"""A model's configuration read from a file is checked before anything is built (trial 16d, bugs 2 to 5).

A GGUF header with 3 KV heads for 4 query heads, 0 layers or a context of 0 crashed with a raw
traceback far from its cause; a NaN epsilon or RoPE base loaded and generated garbage; a layer
count past the tensors present said to delete the cache (which came back, 630 MB each time); a
head count of 0 or an out-of-vocabulary EOS id failed conversion in Python's words. Each is now one
line naming the file, the key and its value, and to get a fresh copy, and nothing is cached.
The files are tiny synthetic GGUFs (tests/gguf_helpers.py) with one metadata value changed.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from nanovllm_core.config import FILE_FAULT
from nanovllm_core.model import loader
from nanovllm_core.model.loader import ModelLoadError, load_model
from tests.conftest import run_main
from tests.gguf_helpers import tokenizer_fields, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_tiny_gguf(folder / "tiny.gguf", tokenizer_fields(loader.default_gguf_path()))


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The converted copies go to a fresh cache under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nanovllm" / "gguf"


def with_value(source, path, key: str, value):
    """A copy of GGUF ``source`` at ``path`` with metadata ``key`` set to ``value`` (the trial's recipe)."""
    import gguf

    path.write_bytes(source.read_bytes())
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][...] = value
    del reader
    return path


def with_config(source, tmp_path, **changes):
    """A folder under ``tmp_path`` linking ``source``'s files, with ``changes`` made to its config.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refusal(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("key, value, why", [
    ("llama.attention.head_count_kv", 3, "which does not divide llama.attention.head_count 4"),  # bug 2: reshape traceback
    ("llama.block_count", 0, "outside 1 to"),  # bug 2: ZeroDivisionError sizing the KV pool
    ("llama.context_length", 0, "outside 1 to"),  # bug 2: index_select traceback in the rotary table
    ("llama.attention.layer_norm_rms_epsilon", np.nan, "not a number in (0, 1)"),  # bug 3: loaded, garbage
    ("llama.rope.freq_base", np.nan, "not a finite number above 0"),  # bug 3
    ("llama.rope.freq_base", 0.0, "not a finite number above 0"),  # bug 3
    ("llama.attention.head_count", 0, "outside 1 to"),  # bug 5: "converting failed (ZeroDivisionError ...)"
    ("tokenizer.ggml.eos_token_id", 10**9, "outside the 512 tokens of tokenizer.ggml.tokens"),  # bug 5: IndexError
    ("llama.attention.head_count_kv", 0, "outside 1 to"),
    ("llama.embedding_length", 0, "outside 1 to"),
    ("llama.rope.dimension_count", 15, "not the head size 16"),
], ids=["kv3", "layers0", "ctx0", "eps-nan", "rope-nan", "rope-0", "heads0", "eos-oov", "kv0", "hidden0", "rope-dims"])
def test_a_gguf_header_value_that_cannot_be_right_is_refused_naming_the_key(tiny_gguf, cache, tmp_path, key, value,
                                                                           why):
    path = with_value(tiny_gguf, tmp_path / "bad.gguf", key, value)
    message = refusal(path)
    shown = "nan" if isinstance(value, float) and math.isnan(value) else repr(value)
    assert message == f"bad.gguf: {key} is {shown}, {why}{message.split(why, 1)[1]}"
    assert message.endswith(f"; {FILE_FAULT}")
    assert not cache.exists() or not list(cache.iterdir())  # nothing converted, nothing half-written


@pytest.mark.parametrize("layers", [1000, 1])
def test_a_layer_count_that_disagrees_with_the_blocks_present_blames_the_file_and_caches_nothing(tiny_gguf, cache,
                                                                                                   tmp_path, layers):
    path = with_value(tiny_gguf, tmp_path / "layers.gguf", "llama.block_count", layers)
    message = refusal(path)
    assert message == (f"layers.gguf: llama.block_count is {layers} but the file's tensors hold blocks blk.0 to blk.1 "
                       f"(2 in all); {FILE_FAULT}")
    assert "delete" not in message  # the fault is the file's: deleting the cache would only loop (trial 16d #4)
    assert not cache.exists() or not list(cache.iterdir())


def test_a_size_that_disagrees_with_the_tensor_shapes_caches_nothing(tiny_gguf, cache, tmp_path):
    path = with_value(tiny_gguf, tmp_path / "ffn7.gguf", "llama.feed_forward_length", 7)
    message = refusal(path)
    assert message.startswith("ffn7.gguf: tensor blk.0.ffn_gate.weight has shape [128, 64] where the header's "
                              "sizes imply [7, 64] (")
    assert "llama.feed_forward_length 7" in message and message.endswith(FILE_FAULT)
    assert not cache.exists() or not list(cache.iterdir())


def test_the_cli_refuses_a_bad_header_in_one_line_with_status_2(tiny_gguf, cache, tmp_path, capsys):
    from nanovllm_core.cli import main

    path = with_value(tiny_gguf, tmp_path / "kv3.gguf", "llama.attention.head_count_kv", 3)
    code, out, err = run_main(main, capsys, "--model", str(path), "--max-tokens", "2")
    assert code == 2 and "Completion" not in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("kv3.gguf: llama.attention.head_count_kv is 3, which does not "
                                                 "divide llama.attention.head_count 4 (one of the two is wrong); "
                                                 f"{FILE_FAULT}")


def test_a_conversion_failure_the_checks_miss_still_says_what_to_do(tiny_gguf, cache, tmp_path, monkeypatch):
    def broken(gguf_file, out):
        (out / "partial.json").write_text("{}")
        raise IndexError("list index out of range")

    monkeypatch.setattr(loader, "_gguf_config_and_tokenizer", broken)
    path = tmp_path / "odd.gguf"
    path.write_bytes(tiny_gguf.read_bytes())
    message = refusal(path)
    assert message == ("converting odd.gguf failed (IndexError: list index out of range): its header or tensors are "
                       f"not what a LLaMA GGUF file holds; {FILE_FAULT}")
    assert not list(cache.iterdir())  # the temporary folder is gone too


@pytest.mark.parametrize("field, value, why", [
    ("num_key_value_heads", 3, "which does not divide num_attention_heads 4"),
    ("num_hidden_layers", 0, "outside 1 to"),
    ("max_position_embeddings", -5, "outside 1 to"),
    ("rms_norm_eps", float("nan"), "not a number in (0, 1)"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 0}, "not a finite number above 0"),
    ("vocab_size", 1.5, "not a whole number"),
    ("rope_scaling", {"rope_type": "linear", "factor": float("inf")}, "not a finite number above 0"),
], ids=["kv3", "layers0", "ctx-neg", "eps-nan", "rope-0", "vocab-float", "scaling-inf"])
def test_a_config_json_number_that_cannot_be_right_is_refused_naming_the_file(tiny_llama_dir, tmp_path, field, value,
                                                                              why):
    folder = with_config(tiny_llama_dir, tmp_path, **{field: value})
    message = refusal(folder)
    key = {"rope_scaling": "rope_scaling.factor", "rope_parameters": "rope_theta"}.get(field, field)
    assert message.startswith(f"{folder / 'config.json'}: {key} is ")
    assert why in message and message.endswith(FILE_FAULT)


@pytest.mark.parametrize("keep_time", [False, True])
def test_a_file_replaced_at_the_same_path_is_converted_afresh(tiny_gguf, cache, tmp_path, keep_time):
    """Trial 18b: the conversion cache was keyed by path and size only, so a file replaced at the same
    path (same size: one header number changed) ran with the old conversion, a NaN rope base included.
    ``keep_time``: the replacement keeps the old modification time (``cp -p``), so only the header's
    hash tells the two apart."""
    import os

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_gguf.read_bytes())
    first = load_model(str(path), torch.device("cpu"), torch.float32)
    theta = first[0].config.rope_theta
    before = os.stat(path)
    with_value(tiny_gguf, path, "llama.rope.freq_base", theta * 2)
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    again = load_model(str(path), torch.device("cpu"), torch.float32)
    assert again[0].config.rope_theta == theta * 2  # not the first conversion's
    assert len([f for f in cache.iterdir() if f.name.startswith("model-")]) == 1  # the first one is gone
    with_value(tiny_gguf, path, "llama.rope.freq_base", np.nan)
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert "not a finite number above 0" in refusal(path)  # refused as at a new path, not run from the cache


def test_a_gguf_whose_head_count_is_wrong_names_both_head_fields(tiny_gguf, cache, tmp_path):
    """Trial 18b #6: head_count 7 (the changed field) was reported as head_count_kv 2 not dividing it."""
    path = with_value(tiny_gguf, tmp_path / "heads7.gguf", "llama.attention.head_count", 7)
    assert refusal(path) == ("heads7.gguf: llama.attention.head_count_kv is 2, which does not divide "
                             "llama.attention.head_count 7 (one of the two is wrong); " + FILE_FAULT)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_config_json_layer_count_that_disagrees_with_the_checkpoint_is_refused(tiny_llama_dir, tmp_path, layers):
    """Trial 18b #3: one layer fewer than the checkpoint's loaded and left the last layer's weights unused."""
    folder = with_config(tiny_llama_dir, tmp_path, num_hidden_layers=layers)
    assert refusal(folder) == (f"{folder / 'config.json'}: num_hidden_layers is {layers} but the checkpoint's tensors "
                               "hold layers model.layers.0 to model.layers.1 (2 in all); the weights do not match "
                               "config.json: take both from one download of the model")


@pytest.mark.parametrize("act", ["gelu", "relu", "swish", None])
def test_a_config_json_activation_other_than_silu_is_refused(tiny_llama_dir, tmp_path, act):
    """Trial 18b #3: hidden_act "gelu" ran with SiLU, silently (vLLM's LlamaMLP refuses it)."""
    folder = with_config(tiny_llama_dir, tmp_path, hidden_act=act)
    assert refusal(folder) == (f"{folder / 'config.json'}: hidden_act is {act!r}, not an activation this engine "
                               "runs (LLaMA-family models use silu, the only one supported); " + FILE_FAULT)


@pytest.mark.parametrize("field, value, bad", [
    ("eos_token_id", 99999999, 99999999),
    ("eos_token_id", [2, 49152], 49152),
    ("bos_token_id", -1, -1),
    ("eos_token_id", True, True),
    ("bos_token_id", "1", "1"),
], ids=["eos-big", "eos-list", "bos-neg", "eos-bool", "bos-str"])
def test_a_config_json_special_token_outside_the_vocabulary_is_refused(tiny_llama_dir, tmp_path, field, value, bad):
    """Trial 18b #3: eos_token_id 99999999 was accepted; the GGUF path refuses the same fault."""
    folder = with_config(tiny_llama_dir, tmp_path, **{field: value})
    assert refusal(folder) == (f"{folder / 'config.json'}: {field} is {bad!r}, not a token id of the 49,152-token "
                               "vocabulary (vocab_size); " + FILE_FAULT)


def test_a_config_json_without_special_tokens_or_activation_still_loads(tiny_llama_dir, tmp_path):
    folder = with_config(tiny_llama_dir, tmp_path, eos_token_id=None, bos_token_id=None, hidden_act="silu")
    net, _, _ = load_model(str(folder), torch.device("cpu"), torch.float32)
    assert net.config.eos_token_ids == ()
