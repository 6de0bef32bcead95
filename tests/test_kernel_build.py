"""The compiled kernels' build: the C API read from each kernel's header, and what a kernel that cannot be built
does (a warning and the fallback, or with GATEDFORMER_REQUIRE_NATIVE=1 an error naming the compiler's first error)."""

from __future__ import annotations

import ast
import ctypes
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gatedformer.kernels import build as _native
from gatedformer.kernels.build import (
    BACKEND_SWITCHES,
    CSRC,
    DeclarationError,
    KernelUnavailable,
    NativeKernel,
    parse_declarations,
    pytorch_operations,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "gatedformer"
KERNELS = ("attention", "cross_entropy", "dropout", "epilogue", "gate", "gru", "local_rnn", "lstm",
           "relative_attention", "sru")
"""The binding modules of gatedformer.kernels, each with a KERNEL built from csrc/<name>.cpp."""


# ---- the header parser ------------------------------------------------------------------------------------------

def _types(declaration: _native.Declaration) -> tuple:
    return declaration.restype, declaration.argtypes


def test_every_type_of_the_c_api_maps_to_its_ctypes_type() -> None:
    declarations = parse_declarations("""
        void returns_nothing(int a, int64_t b, uint64_t c, uint32_t d, size_t e, double f, float g);
        int returns_int(void);
        int64_t returns_int64();
        uint64_t returns_uint64(uint64_t);
        uint32_t returns_uint32(uint32_t x);
        size_t returns_size(size_t n);
        double returns_double(double);
        float returns_float(float x);
        const float* returns_pointer(const float* a, float *b, void* c, const int64_t* d, uint32_t** e,
                                     const double* const f, float g[], const void*, unsigned char* h);
    """, "types.h")
    p = ctypes.c_void_p
    assert {name: _types(d) for name, d in declarations.items()} == {
        "returns_nothing": (None, (ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t,
                                   ctypes.c_double, ctypes.c_float)),
        "returns_int": (ctypes.c_int, ()),
        "returns_int64": (ctypes.c_int64, ()),
        "returns_uint64": (ctypes.c_uint64, (ctypes.c_uint64,)),
        "returns_uint32": (ctypes.c_uint32, (ctypes.c_uint32,)),
        "returns_size": (ctypes.c_size_t, (ctypes.c_size_t,)),
        "returns_double": (ctypes.c_double, (ctypes.c_double,)),
        "returns_float": (ctypes.c_float, (ctypes.c_float,)),
        "returns_pointer": (p, (p, p, p, p, p, p, p, p, p)),
    }
    assert [d.name for d in declarations.values()] == list(declarations)


def test_comments_preprocessor_lines_and_extern_c_are_skipped_and_declarations_may_span_lines() -> None:
    declarations = parse_declarations("""// The C API of x.cpp: int commented_out(long x);
#pragma once
#include <cstdint>
#define SOMETHING(a, b) \\
    long a(b);
#if defined(__AVX2__)
#endif
/* a block comment; with a semicolon
   void also_commented_out(char c); */
extern "C" {
// one declaration over several lines, a comment inside
int64_t spread(const float* x,  // the rows
               int64_t rows, /* and their count */
               double
               scale);
void after(void);
}
extern "C" uint32_t prefixed(uint64_t seed);
""", "spread.h")
    assert {name: _types(d) for name, d in declarations.items()} == {
        "spread": (ctypes.c_int64, (ctypes.c_void_p, ctypes.c_int64, ctypes.c_double)),
        "after": (None, ()),
        "prefixed": (ctypes.c_uint32, (ctypes.c_uint64,)),
    }


@pytest.mark.parametrize(("text", "message"), [
    ("long f(int x);", "bad.h: f: unknown type 'long' of its result"),
    ("int f(int64_t n, unsigned int flags);",
     "bad.h: f: unknown type 'unsigned int' of argument 2 ('unsigned int flags')"),
    ("void f(char c);", "bad.h: f: unknown type 'char' of argument 1"),
    ("void f(long double x);", "bad.h: f: unknown type 'long double' of argument 1"),
    ("int f(void x);", "bad.h: f: unknown type 'void' of argument 1"),
    ("bool f(int x);", "bad.h: f: unknown type 'bool' of its result"),
])
def test_an_unknown_type_is_an_error_naming_the_header_function_and_type(text: str, message: str) -> None:
    with pytest.raises(DeclarationError, match=re.escape(message)):
        parse_declarations(text, "bad.h")


@pytest.mark.parametrize(("text", "message"), [
    ("int f(int x) { return x; }", "is not a function declaration"),
    ("typedef int word;", "is not a function declaration"),
    ("int f(void (*callback)(int));", "is not a function declaration"),
    ("int f(int x, ...);", "unknown type"),
    ("int f(int x)", "does not end with ';'"),
    ("int f(int x); int f(int64_t y);", "f is declared twice"),
    ("struct S { int a; };", "is not a function declaration"),
    ("int& f(int x);", "is not a function declaration"),
])
def test_what_is_not_a_plain_c_declaration_is_refused(text: str, message: str) -> None:
    with pytest.raises(DeclarationError, match=re.escape(message)):
        parse_declarations(text, "bad.h")


# ---- the kernels' sources and libraries -------------------------------------------------------------------------

@pytest.mark.parametrize("name", KERNELS)
def test_each_kernel_loads_and_every_declared_function_has_its_header_types(name: str) -> None:
    kernel = importlib.import_module(f"gatedformer.kernels.{name}").KERNEL
    assert kernel.name == name and kernel.source == CSRC / f"{name}.cpp" and kernel.header == CSRC / f"{name}.h"
    source = kernel.source.read_text()
    assert f'#include "{name}.h"' in source  # so that the compiler checks each definition against its declaration
    assert source.rstrip().endswith('#include "common.h"')
    declarations = kernel.declarations
    assert declarations
    lib = kernel.library()  # with GATEDFORMER_REQUIRE_NATIVE=1 a kernel that cannot be built raises here
    if lib is None:
        pytest.skip(f"{kernel.description} is unavailable here: {kernel.error}")
    for declaration in declarations.values():
        function = getattr(lib, declaration.name)
        assert function.argtypes == list(declaration.argtypes), declaration.name
        assert function.restype is declaration.restype, declaration.name
    assert getattr(lib, f"{name}_abi_version")() == kernel.abi_version
    nm = shutil.which("nm")
    if nm is not None:  # and the header declares every function the library exports (besides common.h's)
        symbols = subprocess.run([nm, "-D", "--defined-only", lib._name], capture_output=True, text=True,
                                 check=True).stdout.split("\n")
        exported = {line.split()[2] for line in symbols if len(line.split()) == 3 and line.split()[1] == "T"}
        common = {f"{name}_{function}" for function in _native._COMMON_FUNCTIONS}
        assert exported - common == set(declarations)


def test_every_csrc_file_is_package_data_and_every_header_is_included_once() -> None:
    files = sorted(p.name for p in CSRC.iterdir())
    assert {p.rsplit(".", 1)[1] for p in files} == {"cpp", "h"}
    assert {p[:-4] for p in files if p.endswith(".cpp")} == set(KERNELS)
    for header in CSRC.glob("*.h"):
        assert "#pragma once" in header.read_text(), header.name
    if tomllib is not None:
        config = tomllib.loads((REPO / "pyproject.toml").read_text())
        data = config["tool"]["setuptools"]["package-data"]["gatedformer"]
        assert {"recipes/*.toml", "kernels/csrc/*.cpp", "kernels/csrc/*.h"} <= set(data)


def test_the_cache_key_covers_every_header(tmp_path: Path) -> None:
    copy = shutil.copytree(CSRC, tmp_path / "csrc")
    kernel = _gate_kernel(copy)
    before = kernel._source_digest()
    (copy / "simd.h").write_text((copy / "simd.h").read_text() + "// a change in a header gate.cpp does not include\n")
    assert kernel._source_digest() != before


_CPP = re.compile(r'^\s*#\s*(include|define|if|pragma)\b|extern "C" \{|\bnamespace \w* ?\{', re.M)
"""What gives C++ away in a string."""


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names of the modules an import statement of ``path`` imports from."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        return [node.module or ""]
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    base = package[:len(package) - (node.level - 1)]
    return [".".join((*base, node.module) if node.module else base)]


def test_no_cpp_is_left_in_python_and_kernels_import_no_layer_above_them() -> None:
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # deferred imports inside functions included
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not _CPP.search(node.value), (path, _CPP.search(node.value))
            if path.is_relative_to(PACKAGE / "kernels") and isinstance(node, (ast.Import, ast.ImportFrom)):
                for module in _imported(path, node):
                    assert not re.match(r"gatedformer\.(ops|nn|models|gates)\b", module), (path, module)


def test_pytorch_operations_turns_every_kernel_off_and_restores_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = [importlib.import_module(f"gatedformer.kernels.{path.stem}").KERNEL
               for path in sorted((PACKAGE / "kernels").glob("*.py"))
               if "KERNEL = NativeKernel(" in path.read_text()]
    assert len(kernels) >= 10 and {kernel.env_var for kernel in kernels} == set(BACKEND_SWITCHES)
    monkeypatch.setenv("GATEDFORMER_GATE_BACKEND", "native")
    monkeypatch.delenv("GATEDFORMER_SRU_BACKEND", raising=False)
    with pytorch_operations():
        assert all(kernel.pick_backend(torch.device("cpu")) == "torch" for kernel in kernels)
    assert os.environ["GATEDFORMER_GATE_BACKEND"] == "native" and "GATEDFORMER_SRU_BACKEND" not in os.environ
    with pytest.raises(ValueError, match="not one of BACKEND_SWITCHES"):
        NativeKernel("x", abi_version=1, env_var="GATEDFORMER_X_BACKEND", description="x", fallback="y")


# ---- a kernel that cannot be built ------------------------------------------------------------------------------

def _gate_kernel(source_dir: Path, abi_version: int = 4) -> NativeKernel:
    return NativeKernel("gate", abi_version=abi_version, env_var="GATEDFORMER_GATE_BACKEND",
                        description="the compiled gate kernel", fallback="PyTorch's own operations",
                        source_dir=source_dir)


def _compiler_or_skip() -> None:
    """What a compile error looks like needs a compiler (under GATEDFORMER_REQUIRE_NATIVE=1 its absence fails)."""
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    if not cxx or shutil.which(cxx[0]) is None:
        if _native.native_required():
            pytest.fail(f"no C++ compiler ({' '.join(cxx)!r}) while GATEDFORMER_REQUIRE_NATIVE=1 is set")
        pytest.skip(f"no C++ compiler here ({' '.join(cxx)!r})")


def _broken_sources(tmp_path: Path) -> tuple[Path, int]:
    """A copy of csrc/ whose gate.cpp does not compile, and the line of its first error."""
    _compiler_or_skip()
    copy = shutil.copytree(CSRC, tmp_path / "csrc")
    lines = (copy / "gate.cpp").read_text().split("\n")
    at = lines.index("namespace {") + 1
    lines[at:at] = ["int broken_here = ;", "int broken_again = ;"]
    (copy / "gate.cpp").write_text("\n".join(lines))
    return copy, at + 1


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GATEDFORMER_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("GATEDFORMER_GATE_BACKEND", raising=False)
    return tmp_path / "cache"


def test_a_broken_kernel_under_require_native_raises_one_line_with_the_compilers_first_error(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources, line = _broken_sources(tmp_path)
    kernel = _gate_kernel(sources)
    monkeypatch.setenv("GATEDFORMER_REQUIRE_NATIVE", "1")
    with pytest.raises(KernelUnavailable) as raised:
        kernel.library()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the compiled gate kernel could not be built: ")
    assert re.search(rf"gate\.cpp:{line}:\d+: error: ", message), message  # the first error, not the second
    assert f"gate.cpp:{line + 1}:" not in message
    assert "GATEDFORMER_REQUIRE_NATIVE=1 is set" in message
    assert f"gate.cpp:{line + 1}:" in kernel.build_log  # the whole output is kept
    with pytest.raises(KernelUnavailable):  # every time, not only the first
        kernel.pick_backend(torch.device("cpu"))
    with pytest.raises(KernelUnavailable, match="cannot build the avx2 gate kernel"):
        kernel.library_for("avx2")
    # a switch to PyTorch asked for explicitly is no error
    monkeypatch.setenv("GATEDFORMER_GATE_BACKEND", "torch")
    assert kernel.pick_backend(torch.device("cpu")) == "torch"


def test_a_broken_kernel_without_require_native_warns_once_in_one_line_and_falls_back(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources, line = _broken_sources(tmp_path)
    kernel = _gate_kernel(sources)
    monkeypatch.delenv("GATEDFORMER_REQUIRE_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning) as warned:
        assert kernel.pick_backend(torch.device("cpu")) == "torch"
    (warning,) = warned
    message = str(warning.message)
    assert "\n" not in message and message.startswith("gatedformer: the compiled gate kernel is unavailable (")
    assert re.search(rf"gate\.cpp:{line}:\d+: error: ", message), message
    assert message.endswith("falling back to PyTorch's own operations")
    assert kernel.library() is None and kernel.error is not None and "\n" not in kernel.error
    with pytest.raises(RuntimeError, match="cannot build the avx2 gate kernel") as raised:
        kernel.library_for("avx2")
    assert not isinstance(raised.value, KernelUnavailable)


def test_a_definition_that_disagrees_with_its_declaration_does_not_compile(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compiler_or_skip()
    copy = shutil.copytree(CSRC, tmp_path / "csrc")
    header = (copy / "gate.h").read_text()
    declared = "void gate_bias_sigmoid(float* x, const float* bias, int64_t rows,"
    assert header.count(declared) == 1
    disagreeing = "void gate_bias_sigmoid(float* x, const float* bias, int rows,"
    (copy / "gate.h").write_text(header.replace(declared, disagreeing))
    monkeypatch.setenv("GATEDFORMER_REQUIRE_NATIVE", "1")
    with pytest.raises(KernelUnavailable, match=r"error: conflicting declaration of C function"):
        _gate_kernel(copy).library()


def test_no_compiler_and_a_stale_library_are_errors_under_require_native(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_REQUIRE_NATIVE", "1")
    monkeypatch.setenv("CXX", "no-such-compiler-gatedformer")
    with pytest.raises(KernelUnavailable, match=r"could not be built: no C\+\+ compiler found"):
        _gate_kernel(CSRC).library()
    monkeypatch.delenv("CXX")
    built = _gate_kernel(CSRC, abi_version=6)
    if built.library() is None:
        pytest.skip(f"the gate kernel is unavailable here: {built.error}")
    stale = _gate_kernel(CSRC, abi_version=7)
    # a library of another ABI wherever this one's build puts its library
    monkeypatch.setattr(stale, "_compile", lambda cxx, out, *flags: shutil.copy(built.library()._name, out))
    with pytest.raises(KernelUnavailable, match="stale gate kernel library in the cache"):
        stale.library()


def test_require_native_takes_1_0_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, required in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("GATEDFORMER_REQUIRE_NATIVE", value)
        assert _native.native_required() is required
    monkeypatch.setenv("GATEDFORMER_REQUIRE_NATIVE", "yes")
    with pytest.raises(ValueError, match="GATEDFORMER_REQUIRE_NATIVE must be 1"):
        _native.native_required()


def test_the_first_error_line_is_the_first_that_says_error() -> None:
    output = ("x.cpp: In function 'int f()':\n"
              "x.cpp:3:9: error: expected primary-expression before ';' token\n"
              "x.cpp:4:9: error: another\n")
    assert _native._first_error(output) == "x.cpp:3:9: error: expected primary-expression before ';' token"
    assert _native._first_error("\n  \nld: cannot find -lmvec: No such file\nmore\n") == \
        "ld: cannot find -lmvec: No such file"
    assert _native._first_error("collect2: ERROR something\n") == "collect2: ERROR something"


def test_kernels_are_built_into_their_own_cache_when_one_is_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "data-cache"))
    monkeypatch.delenv("GATEDFORMER_KERNEL_CACHE", raising=False)
    assert _native.cache_dir() == tmp_path / "data-cache" / "kernels"
    monkeypatch.setenv("GATEDFORMER_KERNEL_CACHE", str(tmp_path / "kernels-here"))
    assert _native.cache_dir() == tmp_path / "kernels-here"
