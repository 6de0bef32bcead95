"""The package uses PyTorch's public API only: no name from torch's internals (``torch._C``, ``torch._library``,
``torch._ops``, ``torch._dynamo``) in ``src/``, so that every torch release the package declares runs it alike."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
INTERNAL = re.compile(r"torch\._(C|library|ops|dynamo)\b")


def internal_names(root: Path) -> list[str]:
    """``path:line: text`` for each line under ``root`` that names one of torch's internals."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if INTERNAL.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_src_names_no_torch_internals() -> None:
    assert internal_names(SRC) == []


def test_the_check_finds_an_internal_name(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import torch\nx = torch._C.parse_schema\ny = torch.library.Library\n")
    (tmp_path / "b.py").write_text("from torch._dynamo import config\n")
    assert internal_names(tmp_path) == ["a.py:2: x = torch._C.parse_schema", "b.py:1: from torch._dynamo import config"]
