"""Small C kernels of this engine, compiled on first use with the system's C compiler and loaded with ctypes.

Three sources use it: ``attention/paged_attention_cpu.c`` (PagedAttention reading the KV
blocks in place), ``model/layer_ops_cpu.c`` (RMSNorm and RoPE, ``model/native_ops.py``) and
``model/block_quant_cpu.c`` (the GGUF block kernels). Each is built with ``$CC`` (else ``cc``) and OpenMP for this CPU
(``-march=native``) into ``<cache_root>/kernels/``, under a name that hashes the source, the
flags, the compiler and the CPU, so later runs (and other processes) load the same file.
A library that cannot be built is reported, never raised: the callers fall back to PyTorch
(each caller also has an environment switch that turns its kernel off).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from nanovllm_core.paths import cache_root

CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[Path, tuple[ctypes.CDLL | None, str | None]] = {}


def _compiler() -> str | None:
    """The C compiler's command line (``$CC``, which may carry arguments such as ``ccache gcc``,
    else ``cc``) with its program resolved on PATH, or None where that program is not found."""
    try:
        parts = shlex.split(os.environ.get("CC") or "cc")
    except ValueError:  # unbalanced quotes
        return None
    path = shutil.which(parts[0]) if parts else None
    return None if path is None else shlex.join([path, *parts[1:]])


def cpu_features(flags: set[str]) -> list[str]:
    """The vector instruction sets ``-march=native`` builds the kernels with, widest first, from
    /proc/cpuinfo's ``flags``: ``["AVX-512", "VNNI", "AMX"]`` on a Sapphire Rapids Xeon,
    ``["AVX-512", "VNNI"]`` on a Zen 4 EPYC, ``["AVX2"]`` on a Zen 3 EPYC, ``[]`` below AVX2."""
    found = ["AVX-512"] if "avx512f" in flags else ["AVX2"] if "avx2" in flags else []
    if {"avx512_vnni", "avx_vnni"} & flags:
        found.append("VNNI")
    if "amx_tile" in flags:
        found.append("AMX")
    return found


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and the instruction sets its kernels are built with, as every figure
    names its machine: ``"AMD EPYC (AVX-512, VNNI)"``. Two CPUs of one model name differ here
    (an "AMD EPYC" of 2026 may be a Zen 3 with AVX2 or a Zen 4 with AVX-512, and the block
    kernels' speed with them), so the name alone does not say which machine a figure is from.
    From ``cpuinfo`` (Linux's /proc/cpuinfo); elsewhere the platform's processor string alone."""
    name, flags = "", set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    features = cpu_features(flags)
    return f"{name} ({', '.join(features)})" if features else name


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join([ln for ln in f if ln.startswith(("model name", "flags"))][:2])
    except OSError:
        return platform.processor() or platform.machine()


def library_path(source: Path, cc: str) -> Path:
    """Where the library built from ``source`` with this compiler for this CPU is (or will be) cached."""
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(CFLAGS), cc, _cpu_identity()]).encode()).hexdigest()
    return cache_root() / "kernels" / f"{source.stem}-{key[:16]}.so"


def _build(source: Path, cc: str, target: Path) -> None:
    """Compile to a temporary file beside ``target``, then rename it there (no half-written library).

    Raises:
        RuntimeError: the compiler failed or timed out (its first error line in the message).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            r = subprocess.run([*shlex.split(cc), *CFLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                               timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{cc} did not finish within {COMPILE_TIMEOUT_S} s") from None
        if r.returncode != 0:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise RuntimeError(f"{cc} failed: {first or f'exit status {r.returncode}, no message'}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


Signature = tuple[object, list]  # (restype, argtypes) of one C function, as ctypes takes them


def load_unless_off(source: Path, signatures: dict[str, Signature], env_switch: str
                    ) -> tuple[ctypes.CDLL | None, str | None]:
    """:func:`load`, or (None, "<env_switch>=0") where that environment variable is "0".

    The switch is read on every call, so a test or an A/B run can turn a C path off and on
    inside one process.
    """
    if os.environ.get(env_switch, "1") == "0":
        return None, f"{env_switch}=0"
    return load(source, signatures)


def load(source: Path, signatures: dict[str, Signature] | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from ``source``, None), or (None, why it is not available); built once per process.

    ``signatures``: ``{function name: (restype, argtypes)}``, declared on the library when it is
    first loaded (later calls get the same, already declared, library).
    """
    done = _loaded.get(source)  # the common case, several times a step: no lock once a library is settled
    if done is not None:
        return done
    with _lock:
        if source not in _loaded:
            cc = _compiler()
            if cc is None:
                _loaded[source] = (None, f"no C compiler was found ({os.environ.get('CC') or 'cc'}); install gcc")
            else:
                try:
                    path = library_path(source, cc)
                    if not path.exists():
                        _build(source, cc, path)
                    lib = ctypes.CDLL(str(path))
                    for name, (restype, argtypes) in (signatures or {}).items():
                        fn = getattr(lib, name)
                        fn.restype, fn.argtypes = restype, argtypes
                    _loaded[source] = (lib, None)
                except (OSError, RuntimeError, AttributeError) as e:
                    _loaded[source] = (None, f"its build failed: {e}")
        return _loaded[source]
