"""Build one of the package's C sources for an older x86-64 instruction set than the machine's own.

The C paths promise the same bits whichever vector instructions a build uses; the tests that
check it build each source for ``x86-64`` (no vector intrinsics), ``haswell`` (AVX2, FMA) and
``skylake-avx512`` (AVX-512), each where this CPU can run it, and compare with the native build.
"""

from __future__ import annotations

import ctypes
import shlex
import subprocess
from pathlib import Path

import pytest

# (-march value, the /proc/cpuinfo flags a CPU needs to run that build)
BUILDS = [("x86-64", set()), ("haswell", {"avx2", "fma"}), ("skylake-avx512", {"avx2", "fma", "avx512f"})]
BUILD_IDS = [b[0] for b in BUILDS]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


def build(tmp_path: Path, source: Path, march: str, needs: set[str], signatures: dict) -> ctypes.CDLL:
    """``source`` compiled with the package's flags but ``-march=<march>``, loaded with ``signatures``.

    Skips the test where this CPU lacks ``needs`` or there is no C compiler.
    """
    from nanovllm_core import native

    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a -march={march} build")
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / f"{source.stem}-{march}.so"
    flags = [f for f in native.CFLAGS if f != "-march=native"] + [f"-march={march}"]
    r = subprocess.run([*shlex.split(cc), *flags, str(source), "-o", str(so), "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(so))
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
