"""BERT's WordPiece tokenizer (the ``tokenizers`` library's), learned from a corpus or read from a ``vocab.txt``, and a
corpus's text as WordPiece ids, cached on disk.

The tokenizer is BERT's: the text cleaned and (uncased) lower-cased with accents stripped, split at whitespace and
punctuation, each word cut into the longest pieces of the vocabulary (``##`` marks a piece inside a word), the
special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0-4 in a learned vocabulary; wherever ``vocab.txt`` puts
them in a given one). A single text is ``[CLS] a [SEP]``, a pair ``[CLS] a [SEP] b [SEP]`` with token types 0 up to
the first ``[SEP]`` and 1 after it, longer pairs cut from the end of the longer side.

A corpus's text for masked language modelling (a registered corpus, or a ``text:PATH`` file whose lines are split
90/5/5 in order): every non-blank line of a split, in order, WikiText's ``<unk>`` read as ``[UNK]``, as one stream of
ids per split. ``valid_fraction`` > 0 takes the validation split from the end of the
training text instead (whole lines). The vocabulary is learned from the training split only.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from gatedformer.io import atomic_open

from ..errors import DataError, GatedformerError
from .corpora import _find_text_file
from .paths import cache_root, find_file, locate
from .registry import SPLITS, TEXT_PREFIX, get_spec, is_text_corpus
from .tokenize import damaged_cache, decode_utf8, ids_checksum
from .verify import read_decoded, verify_file

__all__ = ["SPECIALS", "WordPiece", "corpus_text", "encode_corpus", "require_tokenizers"]

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CACHE_VERSION = 1
_LINES_AT_ONCE = 20_000
_WIKITEXT_UNK = re.compile(r"<unk>")


def require_tokenizers():  # noqa: ANN201 - the module, imported on demand
    """The ``tokenizers`` module, or one line saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise GatedformerError("the BERT tasks need the tokenizers library; install it with pip install "
                               "'gatedformer[bert]'") from None
    return tokenizers


class WordPiece:
    """A BERT WordPiece tokenizer; ``pad_id``, ``unk_id``, ``cls_id``, ``sep_id`` and ``mask_id`` are its specials."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.token_to_id(token) for token in SPECIALS]  # type: ignore[attr-defined]
        missing = [token for token, i in zip(SPECIALS, ids, strict=True) if i is None]
        if missing:
            raise DataError(f"the WordPiece vocabulary lacks {', '.join(missing)}; give a BERT vocab.txt (with "
                            "[PAD] [UNK] [CLS] [SEP] [MASK])")
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = ids
        self.special_ids = tuple(sorted(set(ids)))

    # -- making one --------------------------------------------------------------------------------

    @staticmethod
    def _pipeline(vocab: dict[str, int] | None, lowercase: bool):  # noqa: ANN205
        tk = require_tokenizers()
        model = tk.models.WordPiece(vocab, unk_token="[UNK]") if vocab is not None else \
            tk.models.WordPiece(unk_token="[UNK]")
        tokenizer = tk.Tokenizer(model)
        tokenizer.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                             lowercase=lowercase)
        tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = tk.decoders.WordPiece(prefix="##")
        return tokenizer

    def _finish(self) -> WordPiece:
        tk = require_tokenizers()
        self.tokenizer.post_processor = tk.processors.TemplateProcessing(  # type: ignore[attr-defined]
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", self.cls_id), ("[SEP]", self.sep_id)])
        return self

    @classmethod
    def learn(cls, texts: Iterable[str], vocab_size: int, lowercase: bool = True, min_frequency: int = 2,
              length: int | None = None) -> WordPiece:
        """A vocabulary of ``vocab_size`` pieces (the specials first) learned from ``texts``."""
        tk = require_tokenizers()
        tokenizer = cls._pipeline(None, lowercase)
        trainer = tk.trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                               special_tokens=list(SPECIALS), show_progress=False,
                                               continuing_subword_prefix="##")
        tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
        return cls(tokenizer)._finish()

    @classmethod
    def from_vocab_file(cls, path: str | Path, lowercase: bool = True) -> WordPiece:
        """The tokenizer of a BERT ``vocab.txt`` (one token a line; its line number is its id)."""
        path = Path(path).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read the vocabulary {path} ({getattr(err, 'strerror', None) or err}); give a "
                            "UTF-8 vocab.txt, one token a line") from None
        if lines and lines[-1] == "":
            lines.pop()
        vocab: dict[str, int] = {}
        for number, token in enumerate(lines):
            token = token.rstrip("\r")
            if not token or token in vocab:
                raise DataError(f"{path} line {number + 1}: {'an empty' if not token else 'a repeated'} token "
                                f"{token!r}; every line of vocab.txt must be a token of its own")
            vocab[token] = number
        return cls(cls._pipeline(vocab, lowercase))._finish()

    @classmethod
    def from_json(cls, text: str, where: str = "tokenizer.json") -> WordPiece:
        tk = require_tokenizers()
        try:
            return cls(tk.Tokenizer.from_str(text))._finish()
        except Exception as err:  # the library raises its own exception types for a bad file
            raise DataError(f"{where} is not a tokenizer the tokenizers library reads ({str(err)[:100]}); delete it "
                            "to learn the vocabulary again") from None

    # -- saving it -----------------------------------------------------------------------------------

    def to_json(self) -> str:
        return self.tokenizer.to_str()  # type: ignore[attr-defined]

    def vocab_txt(self) -> str:
        """``vocab.txt``: every token in id order, one a line."""
        vocab = self.tokenizer.get_vocab()  # type: ignore[attr-defined]
        tokens = sorted(vocab, key=vocab.__getitem__)
        return "".join(token + "\n" for token in tokens)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()  # type: ignore[attr-defined]

    # -- using it ------------------------------------------------------------------------------------

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """The pieces of every text, without special tokens."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)  # type: ignore[attr-defined]
        return [encoding.ids for encoding in encodings]

    def encode_pairs(self, first: Sequence[str], second: Sequence[str] | None, max_len: int
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """The ids and token types of ``[CLS] a [SEP]`` (or ``[CLS] a [SEP] b [SEP]``) for every example, at most
        ``max_len`` tokens each."""
        tokenizer = self.tokenizer
        tokenizer.enable_truncation(max_len, strategy="longest_first")  # type: ignore[attr-defined]
        try:
            inputs = list(first) if second is None else list(zip(first, second, strict=True))
            encodings = tokenizer.encode_batch(inputs)  # type: ignore[attr-defined]
        finally:
            tokenizer.no_truncation()  # type: ignore[attr-defined]
        return [e.ids for e in encodings], [e.type_ids for e in encodings]

    def piece(self, i: int) -> str:
        """The vocabulary's piece of id ``i`` as written there (a word's continuation with its ``##``)."""
        return self.tokenizer.id_to_token(int(i))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# A corpus's text


def corpus_text(name: str, data_dir: str | Path | None = None) -> tuple[dict[str, str], list[dict]]:
    """The text of every split of the registered corpus ``name`` (verified), or of a ``text:PATH`` file (its lines
    split 90/5/5 in order), and what identifies each file."""
    if is_text_corpus(name):
        path = _find_text_file(name[len(TEXT_PREFIX):], data_dir)
        text = decode_utf8(path.read_bytes(), path, "convert it to UTF-8 (e.g. `iconv -t utf-8`)")
        lines = text.split("\n")
        cuts = (len(lines) * 90 // 100, len(lines) * 95 // 100)
        if not 0 < cuts[0] < cuts[1] < len(lines):
            raise DataError(f"text file {path} has {len(lines)} lines, too few for a 90/5/5 split; give one with a "
                            "few hundred lines")
        st = path.stat()
        parts = (lines[: cuts[0]], lines[cuts[0]: cuts[1]], lines[cuts[1]:])
        return ({split: "\n".join(part) for split, part in zip(SPLITS, parts, strict=True)},
                [{"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}])
    spec = get_spec(name)
    if spec.split_by_position:
        raise DataError(f"{spec.name} is one file of bytes, not text in lines; pick a word-level corpus such as "
                        "wikitext2 or wikitext103 for masked language modelling")
    root = locate(spec, data_dir)
    texts, sources = {}, []
    fix = f"re-download with `gatedformer data fetch {spec.name}`"
    for f in spec.files:
        path = find_file(root, f.candidates)
        assert path is not None  # locate() checked
        facts = verify_file(path, f, root, spec.name)
        texts[f.split] = decode_utf8(read_decoded(path, spec.name), path, fix)
        sources.append({"split": f.split, "sha256": facts["sha256"]})
    return texts, sources


def _lines(text: str) -> list[str]:
    # Lines end at "\n" only; WikiText's "<unk>" (a word the corpus dropped) is the tokenizer's own [UNK].
    return [_WIKITEXT_UNK.sub("[UNK]", line) for line in text.split("\n") if line.strip()]


def _split_lines(texts: dict[str, str], valid_fraction: float) -> dict[str, list[str]]:
    lines = {split: _lines(texts[split]) for split in SPLITS}
    if valid_fraction > 0:
        train = lines["train"]
        cut = len(train) - max(1, round(len(train) * valid_fraction))
        if cut < 1:
            raise DataError(f"mlm.valid_fraction={valid_fraction} leaves no training text; lower it")
        lines["train"], lines["valid"] = train[:cut], train[cut:]
    return lines


def _cache_dir() -> Path:
    return cache_root() / "wordpiece"


def _key(parts: dict) -> str:
    tk = require_tokenizers()
    blob = json.dumps({**parts, "version": CACHE_VERSION, "tokenizers": tk.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _load_cached(stem: str) -> tuple[str, dict[str, np.ndarray]] | None:
    folder = _cache_dir()
    try:
        meta = json.loads((folder / f"{stem}.json").read_text(encoding="utf-8"))
        if not isinstance(meta.get("sha256"), dict):
            return None  # an entry from before checksums were recorded is built again, silently
        ids = {}
        for split, n in meta["lengths"].items():
            path = folder / f"{stem}.{split}.npy"
            array = np.load(path, allow_pickle=False)
            if array.ndim != 1 or len(array) != n:
                return None
            if ids_checksum(array) != meta["sha256"].get(split):
                damaged_cache(path)
                return None
            ids[split] = array
        return meta["tokenizer"], ids
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_cached(stem: str, tokenizer: WordPiece, ids: dict[str, np.ndarray]) -> None:
    folder = _cache_dir()
    try:
        for split, array in ids.items():
            with atomic_open(folder / f"{stem}.{split}.npy") as handle:
                np.save(handle, array, allow_pickle=False)
        record = {"lengths": {s: len(a) for s, a in ids.items()},
                  "sha256": {s: ids_checksum(a) for s, a in ids.items()}, "tokenizer": tokenizer.to_json()}
        with atomic_open(folder / f"{stem}.json", "w") as handle:  # last: its presence marks a complete entry
            json.dump(record, handle)
    except OSError as err:
        # A read-only or full cache must not stop training; it only makes the next start slower.
        warnings.warn(f"could not write the WordPiece cache in {folder}: {err}", stacklevel=3)


def encode_corpus(name: str, data_dir: str | Path | None, tokenizer: WordPiece | None, vocab_size: int,
                  lowercase: bool = True, min_frequency: int = 2, valid_fraction: float = 0.0,
                  given: str = "") -> tuple[WordPiece, dict[str, np.ndarray]]:
    """The tokenizer (``tokenizer`` if given, else one learned from the training split) and every split of the
    corpus as one stream of ids each (int32), cached under the cache folder. ``given`` identifies a given tokenizer
    in the cache key (e.g. its vocabulary's hash)."""
    texts, sources = corpus_text(name, data_dir)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] + "-" + _key({
        "corpus": name, "sources": sources, "valid_fraction": valid_fraction,
        "tokenizer": hashlib.sha256(tokenizer.to_json().encode()).hexdigest() if tokenizer is not None else None,
        "given": given, "vocab_size": vocab_size, "lowercase": lowercase, "min_frequency": min_frequency})
    cached = _load_cached(stem)
    if cached is not None:
        return (tokenizer or WordPiece.from_json(cached[0], "the WordPiece cache")), cached[1]
    lines = _split_lines(texts, valid_fraction)
    if tokenizer is None:
        tokenizer = WordPiece.learn(lines["train"], vocab_size, lowercase, min_frequency, len(lines["train"]))
    ids = {}
    for split, split_lines in lines.items():
        chunks = [np.zeros(0, dtype=np.int32)]
        for start in range(0, len(split_lines), _LINES_AT_ONCE):  # WikiText-103's ids as Python ints would not fit
            pieces = tokenizer.encode_texts(split_lines[start:start + _LINES_AT_ONCE])
            chunks.append(np.fromiter((i for line in pieces for i in line), dtype=np.int32,
                                      count=sum(len(line) for line in pieces)))
        ids[split] = np.concatenate(chunks)
        if not len(ids[split]):
            raise DataError(f"the {split} split of {name} holds no text to train or score on")
    _save_cached(stem, tokenizer, ids)
    return tokenizer, ids
