"""Opening checkpoint files, and saying in one line what is wrong with one that does not open.

The readers fail on a broken file in their own words: the ``gguf`` package's in numpy's
("cannot reshape array of size 66784 into shape (576,360)", "GGUF magic invalid"), safetensors'
in its parser's ("Error while deserializing header: invalid header length"). Here the file's
layout is read to tell the two usual cases apart, and to say what to do about each:

- not a file of that format at all (a text file, another format);
- a file cut short: fewer bytes than its header says (an interrupted download or copy);
- (GGUF) a corrupt header: a field holding a value no writer makes (overwritten bytes).

GGUF (versions 2 and 3, little-endian; ggml's ``docs/gguf.md``): the magic ``GGUF``, uint32
version, uint64 tensor count, uint64 metadata count; each metadata entry a string key, a uint32
type and a value (a string is a uint64 length and its bytes; an array a uint32 element type, a
uint64 count and the elements); each tensor a string name, uint32 number of dimensions, uint64
dimensions, uint32 ggml type and uint64 offset into the data section, which starts at the next
multiple of ``general.alignment`` (32 when absent). The file's size is the data section's start
plus the end of its last tensor.

safetensors: a uint64 header length N, N bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}``), then the data: the file's size is ``8 + N`` plus the
largest ``end``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

from nanovllm_core import untrusted

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bytes of each fixed-size metadata value type (GGUFValueType): 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
REDOWNLOAD = "re-download it or convert it to GGUF again"


class _EndsInHeader(Exception):
    """The file ends before its header does."""


class _CorruptHeader(Exception):
    """A header field holds a value no GGUF writer makes (``str(self)``: which, where, what it holds):
    overwritten bytes, not a file cut short (trial 15b: a full-length file whose header bytes were
    overwritten was said to be "cut short")."""


# No field of a real GGUF header asks for more: a string or array of more than a TiB, more
# tensors or metadata entries than that, a key longer than the format's 65,535 bytes, a tensor of
# more than ggml's 4 dimensions. A field past these is overwritten bytes (random bytes make huge
# numbers), while a file cut short inside its header stops at a field of a plausible size.
MAX_PLAUSIBLE = 2**40
MAX_KEY_BYTES = 65_535
MAX_DIMS = 4


def open_gguf(path: str | Path) -> Any:
    """``gguf.GGUFReader`` over ``path`` (it maps the file; nothing is copied).

    Raises:
        ValueError: the file will not open, in one line naming it, saying what it is (empty, not a
            GGUF file, cut short: N bytes where the header says M, an unsupported version, a
            corrupt or malformed header) and what to do; never the reader's numpy wording.
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(gguf_problem(Path(path), e)) from None


def gguf_problem(path: Path, error: BaseException | None = None) -> str:
    """Why ``path`` is not a readable GGUF file, as one line with what to do.

    ``error``: what the reader raised; only its type is named, when the file's layout shows nothing wrong.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
            if size == 0:
                return f"{path} is empty (0 bytes), not a GGUF model; pass a .gguf model file (if this one should be one, re-download it)"
            if head != MAGIC:
                shown = repr(head)[1:]  # b'XXXX' -> 'XXXX'
                return (f"{path} is not a GGUF file: its first bytes are {shown}, not 'GGUF'; pass a .gguf model "
                        "file (if this one should be one, re-download it)")
            expected = expected_size(f, size)
    except _EndsInHeader:
        return f"{path} is cut short: its {size:,} bytes end inside its header; {REDOWNLOAD}"
    except _CorruptHeader as e:
        return f"{path} has a corrupt GGUF header: {e}; {REDOWNLOAD}"
    except OSError as e:
        return f"{path} could not be read ({type(e).__name__}: {e.strerror or e}); check the file and its permissions"
    except ValueError as e:
        return f"{path} is not a GGUF file this engine reads: {e}"
    if expected > size:
        return f"{path} is cut short: {size:,} bytes where its header says {expected:,}; {REDOWNLOAD}"
    return f"{path} has a GGUF header the gguf package cannot read ({type(error).__name__}); {REDOWNLOAD}"


def expected_size(f: BinaryIO, size: int) -> int:
    """Bytes the GGUF header at the start of ``f`` says the file holds (``size``: its actual size).

    Reads the header only, skipping over values (a 49,152-token vocabulary is skipped, not read).

    Raises:
        _EndsInHeader: the file ends before the header does (a plausible header, cut short).
        _CorruptHeader: a field holds a value no GGUF writer makes (:data:`MAX_PLAUSIBLE`, ...).
        ValueError: an unsupported version, or a type number the format does not define.
    """
    def plausible(value: int, what: str, at: int, most: int = MAX_PLAUSIBLE) -> int:
        if value > most:
            raise _CorruptHeader(f"{what} at byte {at:,} is {value:,}, more than any GGUF file holds")
        return value

    def skip(n: int) -> None:
        end = f.tell() + n
        if end > size:
            raise _EndsInHeader
        f.seek(end)

    def length(what: str) -> int:
        at = f.tell()
        return plausible(read("<Q"), what, at)

    def read(fmt: str) -> int:
        raw = f.read(struct.calcsize(fmt))
        if len(raw) < struct.calcsize(fmt):
            raise _EndsInHeader
        return struct.unpack(fmt, raw)[0]

    def skip_value(kind: int) -> None:
        if kind == _STRING:
            skip(length("a string's length"))
        elif kind == _ARRAY:
            item, count = read("<I"), length("an array's length")
            if item in _SCALAR_BYTES:
                skip(count * _SCALAR_BYTES[item])
            else:
                for _ in range(count):
                    skip_value(item)
        elif kind in _SCALAR_BYTES:
            skip(_SCALAR_BYTES[kind])
        else:  # GGUF's value types are 0 to 12 in every version: another number is an overwritten byte
            raise _CorruptHeader(f"a metadata value's type at byte {f.tell() - 4:,} is {kind}, not one GGUF defines")

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    f.seek(len(MAGIC))
    version = read("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version}, where this engine reads versions "
                         f"{' and '.join(map(str, VERSIONS))}; convert the model again with a current llama.cpp")
    tensors, entries = length("the tensor count"), length("the metadata count")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(entries):
        at = f.tell()
        key_len = plausible(read("<Q"), "a metadata key's length", at, MAX_KEY_BYTES)
        if f.tell() + key_len > size:
            raise _EndsInHeader
        key = f.read(key_len)
        kind = read("<I")
        if key == b"general.alignment" and kind == _UINT32:
            alignment = read("<I") or DEFAULT_ALIGNMENT
        else:
            skip_value(kind)
    end = 0
    for _ in range(tensors):
        skip(length("a tensor name's length"))
        at = f.tell()
        dims = [length("a tensor dimension") for _ in range(plausible(read("<I"), "a tensor's dimension count", at,
                                                                        MAX_DIMS))]
        kind, offset = read("<I"), read("<Q")
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor type {kind} is not one this gguf package knows; {REDOWNLOAD}") from None
        end = max(end, offset + math.prod(dims) // block * block_bytes)
    start = -(-f.tell() // alignment) * alignment
    return start + end


def safetensors_problem(path: Path) -> str:
    """Why ``path`` is not a readable safetensors file, as one line without what to do (the caller
    knows: re-download the model, or convert it again)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(9)
            if size == 0:
                return f"{path.name} is empty (0 bytes)"
            if len(head) < 9:
                return f"{path.name} is cut short: its {size} bytes end inside its header"
            length = struct.unpack("<Q", head[:8])[0]
            if head[8:9] != b"{":  # the JSON header follows the length at once
                return (f"{path.name} is not a safetensors file: its first bytes {repr(head[:8])[1:]} are not a header "
                        "length followed by a JSON header")
            if 8 + length > size:
                return f"{path.name} is cut short: its {size:,} bytes end inside its header"
            f.seek(8)
            header = untrusted.loads(f.read(length))  # nested too deeply: a ValueError too, not a RecursionError
    except OSError as e:
        return f"{path.name} could not be read ({type(e).__name__}: {e.strerror or e})"
    except ValueError:
        return f"{path.name} is not a safetensors file: its header is not JSON"
    try:
        expected = 8 + length + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                    default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return f"{path.name} has a safetensors header that does not describe its tensors"
    if expected > size:
        return f"{path.name} is cut short: {size:,} bytes where its header says {expected:,}"
    return f"{path.name} has a safetensors header its reader refuses"
