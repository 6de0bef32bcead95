"""Small C++ kernels built from the package's own sources on first use and loaded with :mod:`ctypes`.

Each kernel's source is a file of ``csrc/`` (package data beside this module): ``<kernel>.cpp``, which includes the
shared headers it needs (``parallel.h``: the helper that splits work between threads; ``simd.h``, ``sigmoid.h``,
``philox.h``, ``packed_gemm.h``: vector helpers, the recurrent cells' sigmoid, the dropout mask generator and MKL's
packed products; ``common.h``: the ABI check and CPU probes every library exports) and ``<kernel>.h``, which declares
the ``extern "C"`` functions that Python calls. The ``.cpp`` includes its own header, so the compiler rejects a
definition that disagrees with its declaration, and :func:`parse_declarations` reads that header for the argument
and result types that ctypes is given: each signature is written once.

No source includes a Torch header, so a kernel builds in about a second and does not depend on the Torch version.
It is compiled with the system C++ compiler (``$CXX``, else ``c++``) the first time it is needed, never at import,
into ``$GATEDFORMER_KERNEL_CACHE``, else ``$GATEDFORMER_CACHE/kernels``, else ``~/.cache/gatedformer/kernels``
(a folder of its own, e.g. node-local disk, or one kept across test sessions), under a name hashed from every file of
``csrc/`` and the flags, so a changed source or header is rebuilt and concurrent processes never load half a file.
On CPUs with AVX2 and FMA a second build for those instructions is preferred, and kernels written for 512-bit
vectors add a third for CPUs with AVX-512 (``GATEDFORMER_KERNEL_ISA=avx2`` or ``baseline`` caps the choice, e.g. to
compare them). Kernels split their work with OpenMP when the compiler has it, on the same thread pool as PyTorch
(see ``parallel_chunks`` in ``csrc/parallel.h``). If no compiler is found or the build fails, a warning naming the
compiler's first error is given once and the caller falls back to its PyTorch implementation; with
``GATEDFORMER_REQUIRE_NATIVE=1`` (as CI sets it) that is an error instead, :class:`KernelUnavailable`.

Each kernel has an environment variable that picks ``native``, ``torch`` or ``auto`` (the default); ``torch`` turns
the kernel off, ``GATEDFORMER_REQUIRE_NATIVE`` or not.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["BACKENDS", "BACKEND_SWITCHES", "CSRC", "ISAS", "Declaration", "DeclarationError", "KernelUnavailable",
           "NativeKernel", "constant_under_compile", "kernel_threads", "native_required", "parse_declarations",
           "prepare_compile", "pytorch_operations"]

BACKENDS = ("auto", "native", "torch")
ISAS = ("baseline", "avx2", "avx512")
"""Instruction sets a kernel may be built for, in order of preference from last to first."""
_ISA_FLAGS = {
    "baseline": (),
    "avx2": ("-mavx2", "-mfma"),
    # GCC tunes most AVX-512 CPUs for 256-bit vectors unless told otherwise.
    "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
               "-mprefer-vector-width=512"),
}

CSRC = Path(__file__).resolve().parent / "csrc"
"""The kernels' C++ sources and headers (package data)."""

_ELEMENTS_PER_THREAD = 1 << 15

BACKEND_SWITCHES = ("GATEDFORMER_ATTENTION_BACKEND", "GATEDFORMER_CROSS_ENTROPY_BACKEND", "GATEDFORMER_DROPOUT_BACKEND",
                    "GATEDFORMER_GATE_BACKEND", "GATEDFORMER_GRU_BACKEND", "GATEDFORMER_SRU_BACKEND")
"""Every kernel's switch (``auto``, ``native`` or ``torch``), read at each call; a new kernel's ``env_var`` is one of
these or is added here."""

REQUIRE_NATIVE = "GATEDFORMER_REQUIRE_NATIVE"
"""The environment variable that makes a kernel that cannot be built an error (``1``) instead of a fallback."""


HEAVY_ELEMENT = 8
"""The ``cost`` of an element for kernels that draw a Philox-4x32-10 mask word per element or normalise rows
(dropout, dropout + residual + LayerNorm): about eight plain element-wise passes, so such a call is worth a second
thread at an eighth of the elements a plain pass needs."""


def kernel_threads(numel: int, elements_per_thread: int | None = None, *, cost: int = 1) -> int:
    """Threads for a kernel call: Torch's intra-op count, but none with less than ``elements_per_thread``
    elements of work (default ~32k), each element counting ``cost`` times (see :data:`HEAVY_ELEMENT`)."""
    return max(1, min(torch.get_num_threads(), numel * cost // (elements_per_thread or _ELEMENTS_PER_THREAD)))


def isa_cap() -> str:
    """The most capable instruction set kernels may be built for: ``$GATEDFORMER_KERNEL_ISA``, by default
    ``avx512`` (each kernel still takes only what this CPU has)."""
    cap = os.environ.get("GATEDFORMER_KERNEL_ISA", "").strip().lower() or "avx512"
    if cap not in ISAS:
        raise ValueError(f"GATEDFORMER_KERNEL_ISA must be one of {', '.join(ISAS)}, got {cap!r}")
    return cap


_CONSTANT_FUNCTIONS: list[Callable[..., Any]] = []
_MARKED = False


def constant_under_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, to be marked with :func:`torch.compiler.assume_constant_result` (under ``torch.compile`` its result
    is taken once while dynamo traces, as a constant of the graph) by :func:`prepare_compile`. Marking imports the
    compiler, which costs every ``import gatedformer`` (and every command) about as long as importing torch itself
    and which eager code never needs, so it waits for the first compile."""
    if _MARKED:
        return torch.compiler.assume_constant_result(fn)
    _CONSTANT_FUNCTIONS.append(fn)
    return fn


def prepare_compile() -> None:
    """Marks every :func:`constant_under_compile` function, as ``torch.compile`` of a model that runs the kernels
    needs first (``gatedformer.train.compiling.compile_model`` calls it); later ones are marked as they come."""
    global _MARKED
    for fn in _CONSTANT_FUNCTIONS:
        torch.compiler.assume_constant_result(fn)  # marks fn itself, as documented
    _MARKED = True


@contextlib.contextmanager
def pytorch_operations() -> Iterator[None]:
    """Inside, every model runs PyTorch's operations instead of the compiled kernels (e.g. so that
    ``torch.utils.flop_counter`` sees all the arithmetic); the switches are restored on the way out."""
    saved = {name: os.environ.get(name) for name in BACKEND_SWITCHES}
    os.environ.update(dict.fromkeys(BACKEND_SWITCHES, "torch"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def native_required() -> bool:
    """Whether ``$GATEDFORMER_REQUIRE_NATIVE`` is ``1``: then a kernel that cannot be built raises
    :class:`KernelUnavailable` instead of falling back (unset or ``0``: the fallback and a warning)."""
    value = os.environ.get(REQUIRE_NATIVE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{REQUIRE_NATIVE} must be 1 (or 0, or unset), got {value!r}")
    return value == "1"


def cache_dir() -> Path:
    """``$GATEDFORMER_KERNEL_CACHE``, else ``$GATEDFORMER_CACHE/kernels``, else ``~/.cache/gatedformer/kernels``
    (beside the data caches)."""
    own = os.environ.get("GATEDFORMER_KERNEL_CACHE", "").strip()
    if own:
        return Path(own).expanduser()
    env = os.environ.get("GATEDFORMER_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "gatedformer") / "kernels"


class KernelUnavailable(RuntimeError):
    """A compiled kernel that could not be built or loaded while ``GATEDFORMER_REQUIRE_NATIVE=1`` is set. Its message
    is one line: the kernel and the compiler's first error (the whole output is the kernel's ``build_log``)."""


# ---- the kernels' C API, read from their headers --------------------------------------------------------------

_C_TYPES: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "uint32_t": ctypes.c_uint32,
    "size_t": ctypes.c_size_t,
    "double": ctypes.c_double,
    "float": ctypes.c_float,
}
"""The types a kernel's C API may use, and their ctypes; any pointer is passed as ``c_void_p``."""

_QUALIFIERS = frozenset({"const", "volatile", "restrict", "__restrict", "__restrict__"})
_COMMENT_OR_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)
_PREPROCESSOR_LINE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
_EXTERN_C = re.compile(r'\bextern\s+"C"')
_DECLARATION = re.compile(r"^(?P<result>[A-Za-z_][\w\s*]*?)\s*(?<=[\s*])(?P<name>[A-Za-z_]\w*)\s*"
                          r"\((?P<parameters>[^()]*)\)$")
_TYPE_TOKEN = re.compile(r"[A-Za-z_]\w*|\*|\[[^\]]*\]|\S")


class DeclarationError(ValueError):
    """A kernel header that declares something :func:`parse_declarations` does not take (a type outside
    :data:`_C_TYPES`, a definition, a function pointer, ...); the message names the header, function and type."""


@dataclass(frozen=True)
class Declaration:
    """One function of a kernel's C API: its ctypes ``restype`` (``None`` for ``void``) and ``argtypes``."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]


def _is_word(token: str) -> bool:
    return re.fullmatch(r"[A-Za-z_]\w*", token) is not None


def _ctype(spelling: str, *, header: str, function: str, what: str, parameter: bool) -> Any:
    """The ctypes type of one C type, ``spelling`` being a parameter (with or without its name) or a result."""
    tokens = [t for t in _TYPE_TOKEN.findall(spelling) if t not in _QUALIFIERS]
    array = any(t.startswith("[") for t in tokens)
    tokens = [t for t in tokens if not t.startswith("[")]
    # a parameter's name is its last word where a type precedes it: `int64_t n`, `float* x` (but not `int64_t`)
    if parameter and len(tokens) > 1 and _is_word(tokens[-1]) and (_is_word(tokens[-2]) or tokens[-2] == "*"):
        tokens = tokens[:-1]
    words = [t for t in tokens if t != "*"]
    if words and all(_is_word(w) for w in words) and tokens[:len(words)] == words:
        if "*" in tokens or array:  # any pointer: the type's words, then only stars
            return ctypes.c_void_p
        if len(words) == 1 and words[0] in _C_TYPES and not (parameter and words[0] == "void"):
            return _C_TYPES[words[0]]
    spelled = " ".join(tokens) or spelling.strip()
    raise DeclarationError(f"{header}: {function}: unknown type {spelled!r} of {what} (a kernel's C API takes "
                           f"{', '.join(_C_TYPES)} and pointers)")


def parse_declarations(text: str, header: str = "<header>") -> dict[str, Declaration]:
    """The functions that the C header ``text`` declares, by name, with the ctypes types of their results and
    arguments: ``void`` → ``None``, ``int`` → ``c_int``, ``int64_t`` → ``c_int64``, ``uint64_t`` → ``c_uint64``,
    ``uint32_t`` → ``c_uint32``, ``size_t`` → ``c_size_t``, ``double`` → ``c_double``, ``float`` → ``c_float``, and
    any pointer → ``c_void_p``. Comments, preprocessor lines and ``extern "C"`` (a block or a prefix) are skipped;
    a declaration may span lines. Anything else (another type, a definition, a typedef, a function pointer) raises
    :class:`DeclarationError` naming ``header``, the function and the type."""
    text = _COMMENT_OR_STRING.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)
    text = _PREPROCESSOR_LINE.sub(" ", text)
    text = _EXTERN_C.sub(" ", text).replace("{", " ").replace("}", " ")
    declarations: dict[str, Declaration] = {}
    *statements, rest = text.split(";")
    if rest.strip():
        raise DeclarationError(f"{header}: {' '.join(rest.split())!r} does not end with ';'")
    for statement in statements:
        statement = " ".join(statement.split())
        if not statement:
            continue
        match = _DECLARATION.match(statement)
        if match is None:
            raise DeclarationError(f"{header}: {statement!r} is not a function declaration that this parser reads "
                                   "(one C function, its result and parameters of the types in build._C_TYPES)")
        name, parameters = match["name"], match["parameters"].strip()
        if name in declarations:
            raise DeclarationError(f"{header}: {name} is declared twice")
        restype = _ctype(match["result"], header=header, function=name, what="its result", parameter=False)
        argtypes = []
        if parameters not in ("", "void"):
            for k, parameter in enumerate(parameters.split(","), 1):
                argtypes.append(_ctype(parameter, header=header, function=name,
                                       what=f"argument {k} ({parameter.strip()!r})", parameter=True))
        declarations[name] = Declaration(name, restype, tuple(argtypes))
    return declarations


def bind(lib: ctypes.CDLL, declarations: dict[str, Declaration], header: str) -> None:
    """Sets the ``argtypes`` and ``restype`` of every function of ``lib`` that ``declarations`` (from ``header``)
    declare; raises ``RuntimeError`` if ``lib`` does not export one of them."""
    for declaration in declarations.values():
        try:
            function = getattr(lib, declaration.name)
        except AttributeError:
            raise RuntimeError(f"{header} declares {declaration.name}, which the library does not export") from None
        function.argtypes = list(declaration.argtypes)
        function.restype = declaration.restype


_COMMON_FUNCTIONS = ("abi_version", "cpu_has_avx2_fma", "cpu_has_avx512")
"""What ``csrc/common.h`` defines in every library, ``int <kernel>_<function>(void)`` each."""


def _first_error(output: str) -> str:
    """The line of a compiler's output that names its first error (else its first line), for a one-line message."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for marker in ("error:", "error"):
        for line in lines:
            if marker in line.lower():
                return line
    return lines[0] if lines else "no output"


def _checksum_path(library: Path) -> Path:
    """Where the SHA-256 of a built library is recorded: beside it, ``<name>.so.sha256``."""
    return library.with_name(library.name + ".sha256")


def _library_checksum(library: Path) -> str:
    digest = hashlib.sha256()
    with open(library, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _recorded_checksum(library: Path) -> str | None:
    """The SHA-256 recorded when ``library`` was built; ``None`` where none was (a build of an earlier version)."""
    try:
        with open(_checksum_path(library), "rb") as handle:
            return handle.read(100).decode("ascii").strip()
    except (OSError, ValueError):
        return None


class _BuildFailed(RuntimeError):
    """A compiler or linker run that failed: ``str()`` is its first error line, ``log`` the whole output."""

    def __init__(self, summary: str, log: str) -> None:
        super().__init__(summary)
        self.log = log


# ---- one kernel ------------------------------------------------------------------------------------------------

class NativeKernel:
    """One C++ library: ``csrc/<name>.cpp``, the C API its header ``csrc/<name>.h`` declares, and the backend
    switch that selects it.

    ``abi_version`` is compiled in (``-DGATEDFORMER_KERNEL_ABI``, see ``csrc/common.h``) and checked when a library
    is loaded. With ``fast_math`` the first build tries ``-ffast-math`` and glibc's vector maths library (``exp()``
    vectorised); it is compiled and linked in two steps on purpose, because linking a shared object with
    ``-ffast-math`` makes GCC < 13 add ``crtfastmath.o``, which turns on flush-to-zero for the whole process as soon
    as the library is loaded. ``extra_cflags`` go to every build. ``avx512`` marks a source with 512-bit code paths
    (``#if defined(__AVX512F__)``) worth a build of its own on CPUs that have AVX-512. ``source_dir`` (default
    :data:`CSRC`) is the folder of the sources, e.g. a copy for a test.
    """

    def __init__(self, name: str, *, abi_version: int, env_var: str, description: str, fallback: str,
                 fast_math: bool = False, extra_cflags: tuple[str, ...] = (), avx512: bool = False,
                 source_dir: Path | str | None = None) -> None:
        self.name = name
        self.source_dir = CSRC if source_dir is None else Path(source_dir)
        self.source = self.source_dir / f"{name}.cpp"
        self.header = self.source_dir / f"{name}.h"
        self.abi_version = abi_version
        if env_var not in BACKEND_SWITCHES:
            raise ValueError(f"kernel {name}: env_var {env_var!r} is not one of BACKEND_SWITCHES; add it there")
        self.env_var = env_var
        self.description = description
        self.fallback = fallback
        defines = (f"-DGATEDFORMER_KERNEL_NAME={name}", f"-DGATEDFORMER_KERNEL_ABI={abi_version}")
        optimise = ("-O3", "-ffast-math", *extra_cflags) if fast_math else ("-O3", *extra_cflags)
        maths = ("-lmvec", "-lm") if fast_math else ()
        # Flag sets tried in order: with OpenMP (see parallel_chunks), then without, then without fast maths.
        openmp = ((*defines, *optimise, "-fopenmp", "-pthread"), ("-fopenmp", "-pthread", *maths))
        self._builds = (openmp, ((*defines, *optimise, "-pthread"), ("-pthread", *maths)))
        if fast_math:
            self._builds += (((*defines, "-O3", *extra_cflags, "-pthread"), ("-pthread",)),)
        self._vector_isas = ("avx512", "avx2") if avx512 else ("avx2",)
        self.isa: str | None = None
        """The instruction set of the loaded library, once it is built."""
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._declarations: dict[str, Declaration] | None = None
        self.error: str | None = None
        """Why the library could not be built or loaded, in one line (the compiler's first error)."""
        self.build_log: str | None = None
        """The whole output of the compiler run that failed, if one did."""
        self._warned = False

    @property
    def declarations(self) -> dict[str, Declaration]:
        """The functions that ``csrc/<name>.h`` declares, read on first use (see :func:`parse_declarations`)."""
        if self._declarations is None:
            header = f"{self.source_dir.name}/{self.header.name}"
            self._declarations = parse_declarations(self.header.read_text(encoding="utf-8"), header)
        return self._declarations

    # ---- backend selection -------------------------------------------------------------------------

    def requested_backend(self) -> str:
        backend = os.environ.get(self.env_var, "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{self.env_var} must be auto, native or torch, got {backend!r}")
        return backend

    def pick_backend(self, device: torch.device, backend: str | None = None) -> str:
        """``"native"`` or ``"torch"`` for tensors on ``device``; ``backend`` overrides the environment."""
        if backend is None and self._lib is not None and device.type == "cpu" \
                and os.environ.get(self.env_var, "auto") in ("auto", "native"):
            return "native"  # the common case, asked several times per layer and step: no more checks needed
        backend = backend or self.requested_backend()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be auto, native or torch, got {backend!r}")
        if backend == "torch":
            return "torch"
        if device.type != "cpu":
            if backend == "native":
                raise RuntimeError(f"{self.description} runs on the CPU only, not on {device}")
            return "torch"
        if self.library(warn=backend == "auto") is None:
            if backend == "native":
                raise RuntimeError(f"{self.description} is unavailable: {self.error}")
            return "torch"
        return "native"

    # ---- building and loading ----------------------------------------------------------------------

    def library(self, warn: bool = True) -> ctypes.CDLL | None:
        """The compiled library, built on first use; ``None`` (after one warning) if it cannot be built. With
        ``GATEDFORMER_REQUIRE_NATIVE=1`` a library that cannot be built raises :class:`KernelUnavailable` instead,
        unless this kernel's switch says ``torch``."""
        if self._lib is None and self.error is None:
            isa_cap()  # a misspelt cap is an error, not a reason to fall back
            native_required()  # likewise a misspelt requirement
            with self._lock:
                if self._lib is None and self.error is None:
                    try:
                        self._lib = self._build_and_load()
                    except _BuildFailed as err:
                        self.error, self.build_log = str(err), err.log
                    except (RuntimeError, DeclarationError, OSError) as err:
                        self.error = " ".join(str(err).split())
        if self._lib is None:
            if native_required() and self.requested_backend() != "torch":
                raise KernelUnavailable(self.unavailable_message())
            if warn and not self._warned:
                self._warned = True
                warnings.warn(f"gatedformer: {self.description} is unavailable ({self.error}); falling back to "
                              f"{self.fallback}", RuntimeWarning, stacklevel=4)
        return self._lib

    def unavailable_message(self) -> str:
        """The one line of :class:`KernelUnavailable`: the kernel, why it could not be built, and why that is an
        error rather than a fallback."""
        return (f"{self.description} could not be built: {self.error} (an error rather than a fallback to "
                f"{self.fallback} because {REQUIRE_NATIVE}=1 is set)")

    def _build_and_load(self) -> ctypes.CDLL:
        cxx = shlex.split(os.environ.get("CXX") or "c++")
        if not cxx or shutil.which(cxx[0]) is None:
            raise RuntimeError(f"no C++ compiler found (looked for {' '.join(cxx) or 'c++'!r}; set $CXX)")
        cap = isa_cap()
        digest = self._source_digest()
        if not self.declarations:  # read first: a header that this parser cannot read needs no compiler run
            raise RuntimeError(f"{self.header} declares no function")
        failure: _BuildFailed | None = None
        for cflags, ldflags in self._builds:
            try:
                lib = self._build_one(cxx, cflags, ldflags, digest)
            except _BuildFailed as err:
                failure = err  # the last flag set's error is reported: the plainest build's
                continue
            except (OSError, subprocess.SubprocessError) as err:
                failure = _BuildFailed(" ".join(str(err).split()), str(err))
                continue
            for isa in self._vector_isas:
                if ISAS.index(isa) > ISAS.index(cap) or not self._cpu_has(lib, isa):
                    continue
                try:
                    vector_lib = self._build_one(cxx, (*cflags, *_ISA_FLAGS[isa]), ldflags, digest)
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    # an assembler without these instructions: the next set, else the baseline build; but a source
                    # whose code for this CPU does not compile is broken, which CI must see
                    if native_required():
                        log = getattr(err, "log", str(err))
                        raise _BuildFailed(f"the {isa} build failed: {' '.join(str(err).split())}", log) from err
                    continue
                self.isa = isa
                return vector_lib
            self.isa = "baseline"
            return lib
        assert failure is not None
        raise failure

    def _cpu_has(self, lib: ctypes.CDLL, isa: str) -> bool:
        probe = {"baseline": None, "avx2": "cpu_has_avx2_fma", "avx512": "cpu_has_avx512"}[isa]
        return probe is None or bool(getattr(lib, f"{self.name}_{probe}")())

    def library_for(self, isa: str) -> ctypes.CDLL:
        """A build for the instruction set ``isa`` (one of :data:`ISAS`) whatever the library in use, e.g. to
        test each code path against the others; raises ``RuntimeError`` if this CPU or compiler lacks it
        (:class:`KernelUnavailable` where the build fails and ``GATEDFORMER_REQUIRE_NATIVE=1``)."""
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
        cxx = shlex.split(os.environ.get("CXX") or "c++")
        cflags, ldflags = self._builds[0]
        try:
            digest = self._source_digest()
            lib = self._build_one(cxx, cflags, ldflags, digest)
            if not self._cpu_has(lib, isa):
                raise RuntimeError(f"this CPU has no {isa}")
            return lib if isa == "baseline" else self._build_one(cxx, (*cflags, *_ISA_FLAGS[isa]), ldflags, digest)
        except (_BuildFailed, OSError, subprocess.SubprocessError) as err:
            message = f"cannot build the {isa} {self.name} kernel: {' '.join(str(err).split())}"
            if native_required():
                raise KernelUnavailable(f"{message} ({REQUIRE_NATIVE}=1 is set)") from err
            raise RuntimeError(message) from err

    def _source_digest(self) -> str:
        """A hash of every source and header of ``source_dir``: the ``.cpp`` and all it may include."""
        digest = hashlib.sha256()
        for path in sorted(self.source_dir.iterdir()):
            if path.is_file() and path.suffix in (".cpp", ".h"):
                digest.update(f"{path.name}\n{len(path.read_bytes())}\n".encode())
                digest.update(path.read_bytes())
        return digest.hexdigest()

    def _build_one(self, cxx: list[str], cflags: tuple[str, ...], ldflags: tuple[str, ...],
                   digest: str) -> ctypes.CDLL:
        key = "\n".join([digest, *cxx, *cflags, *ldflags, platform.machine(), platform.system()])
        out = cache_dir() / f"{self.name}_kernel_{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"
        if out.exists():
            try:
                # Loading runs the library's code: a file changed since it was built is never loaded.
                if _library_checksum(out) != _recorded_checksum(out):
                    raise RuntimeError("the library does not match the checksum recorded when it was built")
                return self._load(out)
            except (OSError, RuntimeError):
                out.unlink(missing_ok=True)  # damaged, changed or stale: build it again
        self._compile(cxx, out, cflags, ldflags)
        return self._load(out)

    def _load(self, path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        for function in _COMMON_FUNCTIONS:
            try:
                getattr(lib, f"{self.name}_{function}").restype = ctypes.c_int
            except AttributeError:
                raise RuntimeError(f"the {self.name} library exports no {self.name}_{function} (its source must "
                                   'include "common.h" last)') from None
            getattr(lib, f"{self.name}_{function}").argtypes = []
        if getattr(lib, f"{self.name}_abi_version")() != self.abi_version:
            raise RuntimeError(f"stale {self.name} kernel library in the cache")
        bind(lib, self.declarations, f"{self.source_dir.name}/{self.header.name}")
        return lib

    def _compile(self, cxx: list[str], out: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> None:
        """Build the library at ``out`` atomically, so that concurrent processes never load half a file."""
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
            obj, lib = Path(tmp) / f"{self.name}.o", Path(tmp) / out.name
            for cmd in (
                [*cxx, *cflags, "-std=c++14", "-fPIC", "-I", str(self.source_dir), "-c", str(self.source), "-o",
                 str(obj)],
                [*cxx, "-shared", str(obj), "-o", str(lib), *ldflags],
            ):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    log = f"{' '.join(cmd)}\n{proc.stderr}{proc.stdout}"
                    raise _BuildFailed(_first_error(proc.stderr or proc.stdout), log)
            # The checksum lands before the library: whenever the library is there, so is the record of what was
            # built (a concurrent build's record over this library only costs a rebuild, never a load unchecked).
            record = Path(tmp) / _checksum_path(out).name
            record.write_text(_library_checksum(lib) + "\n", encoding="ascii")
            os.replace(record, _checksum_path(out))
            os.replace(lib, out)
