"""Token <-> id mapping, with prompt encoding that follows each corpus's own tokenization."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import DataError

EOS = "<eos>"
UNK = "<unk>"
# How text maps to tokens: "word" (whitespace, <eos> per newline), "ptb-char" (characters, "_" between
# words, <eos> per newline), "char" (every character, newline included) or "byte" (UTF-8 bytes).
KINDS = ("word", "ptb-char", "char", "byte")


@dataclass(frozen=True)
class Vocab:
    """An ordered vocabulary; ``itos[i]`` is the token with id ``i``."""

    itos: tuple[str, ...]
    kind: str = "word"
    stoi: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown vocab kind {self.kind!r}; expected one of {KINDS}")
        itos = tuple(self.itos)
        stoi = {tok: i for i, tok in enumerate(itos)}
        if len(stoi) != len(itos):
            raise ValueError("vocabulary has duplicate tokens")
        object.__setattr__(self, "itos", itos)
        object.__setattr__(self, "stoi", MappingProxyType(stoi))

    @classmethod
    def bytes256(cls) -> Vocab:
        return cls(tuple(chr(i) for i in range(256)), kind="byte")

    def __len__(self) -> int:
        return len(self.itos)

    @property
    def eos_id(self) -> int | None:
        return self.stoi.get(EOS)

    @property
    def unk_id(self) -> int | None:
        return self.stoi.get(UNK)

    def _lookup(self, tok: str, shown: str) -> int:
        i = self.stoi.get(tok)
        if i is None:
            raise DataError(
                f"{shown} is not in the {self.kind}-level vocabulary ({len(self)} tokens); "
                "use only tokens that occur in the training text"
            )
        return i

    def _eos(self) -> int:
        if self.eos_id is None:
            raise DataError("this vocabulary has no <eos> token, so text cannot hold newlines; remove them")
        return self.eos_id

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` tokenized as the corpus was (newlines become <eos> where the corpus has it)."""
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        if self.kind == "char":
            return [self._lookup(ch, f"character {ch!r}") for ch in text]
        ids: list[int] = []
        lines = text.split("\n")
        for n, line in enumerate(lines):
            if self.kind == "word":
                unk = self.unk_id
                for tok in line.split():
                    i = self.stoi.get(tok, unk)
                    ids.append(self._lookup(tok, f"word {tok!r}") if i is None else i)
            else:
                ids.extend(self._lookup(ch, f"character {ch!r}") for ch in "_".join(line.split()))
            if n < len(lines) - 1:
                ids.append(self._eos())
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Readable text for ``ids`` (accepts ints or a 1-D tensor)."""
        ids = [int(i) for i in ids]
        if self.kind == "byte":
            return bytes(ids).decode("utf-8", errors="replace")
        toks = [self.itos[i] for i in ids]
        if self.kind == "char":
            return "".join(toks)
        if self.kind == "ptb-char":
            return "".join("\n" if t == EOS else " " if t == "_" else t for t in toks)
        parts: list[str] = []
        at_line_start = True
        for t in toks:
            if t == EOS:
                parts.append("\n")
                at_line_start = True
            else:
                parts.append(t if at_line_start else " " + t)
                at_line_start = False
        return "".join(parts)

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """:meth:`decode` a piece at a time, as ``ids`` come: the pieces joined are ``decode`` of all of them (bytes
        of a character wait for its last byte)."""
        if self.kind == "byte":
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for i in ids:
                if piece := decoder.decode(bytes((int(i),))):
                    yield piece
            if tail := decoder.decode(b"", final=True):
                yield tail
            return
        at_line_start = True
        for i in ids:
            token = self.itos[int(i)]
            if self.kind == "char":
                yield token
            elif self.kind == "ptb-char":
                yield "\n" if token == EOS else " " if token == "_" else token
            else:
                yield "\n" if token == EOS else token if at_line_start else " " + token
                at_line_start = token == EOS

    def to_json(self) -> dict:
        return {"kind": self.kind, "itos": list(self.itos)}

    @classmethod
    def from_json(cls, data: dict) -> Vocab:
        return cls(tuple(data["itos"]), kind=data["kind"])
