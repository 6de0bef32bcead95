"""Multi30K (English-German) for translation: files, tokenisation, vocabularies and length batching.

Tokenisation scheme (one, used consistently everywhere):

* **Training and evaluation inputs** are the dataset's own lower-cased, punctuation-normalised,
  Moses-tokenised files ``multi30k/tok/<split>.lc.norm.tok.<lang>`` read as whitespace-separated
  tokens, XML escapes (``&apos;``, ``&quot;``...) kept as they are in the files.
* **New text** (``gatedformer translate``) goes through :func:`tokenize`, a small Moses-like
  tokeniser written for this package: unicode quotes to ASCII, lower-casing, punctuation split off
  words (hyphenated words stay whole), English ``'s`` kept on the following token, the same XML
  escapes. On the raw validation sentences it reproduces the ``tok/`` files line for line almost
  always (the tests measure it).
* **BLEU** is SacreBLEU's ``corpus_bleu`` (13a tokenisation, ``lowercase=True``) of the model's
  output, detokenised by :func:`detokenize`, against the **raw** reference files
  ``multi30k/<split>.<lang>``. Case-insensitive because the model is trained on lower-cased text.

Vocabularies come from the training split only: every token seen at least ``translation.min_freq``
times (optionally capped to the most frequent ``translation.src_vocab`` / ``tgt_vocab``), after the
four specials ``<unk> <pad> <bos> <eos>`` (ids 0, 1, 2, 3).

Sequences longer than n (``translation.max_len``, counted with ``<bos>`` and ``<eos>``, so a sentence
may have at most n - 2 tokens): training pairs with a side that long are **skipped** (and counted);
validation and test sentences are **truncated** to n - 2 tokens with a warning, so BLEU is always over
the whole standard split; ``translate`` refuses such a line with a one-line error.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DataError
from .paths import data_dir_candidates, fetch_missing, find_file, holds, offline_switch
from .registry import CorpusSpec, FileSpec
from .verify import verify_file
from .vocab import Vocab

CORPUS = "multi30k"
CORPORA = (CORPUS, "wmt14")
"""The parallel corpora: Multi30K's files are read here, WMT'14's are prepared by :mod:`.wmt14`."""
SPECIALS = ("<unk>", "<pad>", "<bos>", "<eos>")
UNK_ID, PAD_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
PAIRS = (("en", "de"), ("de", "en"))
SPLIT_FILES = {"train": "train", "valid": "val", "test": "test_2016_flickr"}

# Downloads are pinned to a commit of the dataset's repository, so the bytes cannot drift from the hashes below.
# The tokenised files are served as they are; the raw references only gzip-compressed.
_MULTI30K_BASE = ("https://raw.githubusercontent.com/multi30k/dataset/"
                  "a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1")

# sha256 of the files used, as listed in shared/data/MANIFEST.sha256. Mutable on purpose: tests
# point the loader at small synthetic files and empty this.
MULTI30K_SHA256: dict[str, str] = {
    "multi30k/tok/train.lc.norm.tok.en": "08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119",
    "multi30k/tok/train.lc.norm.tok.de": "cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505",
    "multi30k/tok/val.lc.norm.tok.en": "46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec",
    "multi30k/tok/val.lc.norm.tok.de": "97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00",
    "multi30k/tok/test_2016_flickr.lc.norm.tok.en": "5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2",
    "multi30k/tok/test_2016_flickr.lc.norm.tok.de": "c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4",
    "multi30k/val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "multi30k/val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "multi30k/test_2016_flickr.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "multi30k/test_2016_flickr.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
}
# The size of each of those files, by its sha256 (a fact of the content, so files a test swaps in have none): a
# download stops there.
MULTI30K_BYTES: dict[str, int] = {
    "08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119": 1_837_696,
    "cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505": 2_150_008,
    "46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec": 64_608,
    "97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00": 77_273,
    "5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2": 63_307,
    "c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4": 71_917,
    "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227": 63_297,
    "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660": 75_981,
    "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182": 62_076,
    "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16": 70_649,
}


# ---------------------------------------------------------------------------------------------
# Tokenisation


_QUOTES = str.maketrans({"„": '"', "“": '"', "”": '"', "«": '"', "»": '"', "″": '"',
                         "‘": "'", "’": "'", "‚": "'", "´": "'", "`": "'", "–": "-", "—": "-"})
_ESCAPES = (("&", "&amp;"), ("|", "&#124;"), ("<", "&lt;"), (">", "&gt;"), ("'", "&apos;"), ('"', "&quot;"),
            ("[", "&#91;"), ("]", "&#93;"))
_CLOSING = {".", ",", ";", ":", "!", "?", ")", "]", "}", "%", "..."}
_OPENING = {"(", "[", "{", "$", "#"}
# Words whose period is part of them when a sentence goes on after them (a few of Moses' list).
_ABBREVIATIONS = {"ca", "usw", "bzw", "etc", "evtl", "ggf", "nr", "dr", "st", "mr", "mrs", "ms", "jr", "vs", "prof",
                  "sr", "co", "inc", "ltd", "no", "str", "z", "u"}


def tokenize(text: str, lang: str = "en") -> list[str]:
    """Lower-cased, Moses-style tokens of raw ``text``, escaped as in Multi30K's ``tok/`` files."""
    text = " ".join(text.translate(_QUOTES).lower().split())
    text = re.sub(r"\.{2,}", lambda m: f" {m.group(0)} ", text)
    # Every character that is neither a letter, a digit, space, nor . ' , - stands alone.
    text = re.sub(r"([^\w\s.',\-]|_)", r" \1 ", text)
    text = re.sub(r"(?<!\d),|,(?!\d)", " , ", text)
    if lang == "en":  # woman's -> woman 's, don't -> don 't; every other apostrophe stands alone
        text = re.sub(r"(?<=[^\W_])'(?=[^\W\d_])", " \x00", text)
    text = text.replace("'", " ' ").replace("\x00", "'")
    words = text.split()
    tokens: list[str] = []
    for i, word in enumerate(words):
        # A final period comes off unless the word is an abbreviation with inner dots ("u.s.").
        if word.endswith(".") and word != "." and not re.fullmatch(r"\.+", word):
            stem = word[:-1]
            if i == len(words) - 1 or ("." not in stem and stem not in _ABBREVIATIONS):
                tokens.extend([stem, "."])
                continue
        tokens.append(word)
    return [_escape(t) for t in tokens]


def _escape(token: str) -> str:
    for raw, escaped in _ESCAPES:
        token = token.replace(raw, escaped)
    return token


def _unescape(token: str) -> str:
    for raw, escaped in reversed(_ESCAPES):
        token = token.replace(escaped, raw)
    return token


def detokenize(tokens: Sequence[str], lang: str = "de") -> str:
    """Readable text from Moses-style tokens: escapes undone, punctuation re-attached."""
    words = [_unescape(t) for t in tokens]
    out: list[str] = []
    glue_next = True  # no space before the first word
    quote_open = False
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        glue = glue_next
        glue_next = False
        if word in _CLOSING:
            glue = True
        elif word in _OPENING:
            glue_next = True
        elif word == '"':
            if quote_open:
                glue = True
            else:
                glue_next = True
            quote_open = not quote_open
        elif word == "'":
            if out and out[-1][-1:].isalnum() and nxt[:1].isalnum():
                glue = glue_next = True  # "disney ' s" -> "disney's"
        elif word.startswith("'") and len(word) > 1 and out:
            glue = True  # English "'s", "'re"
        out.append(word if glue or not out else " " + word)
    return "".join(out)


def text_tokens(text: str, lang: str, corpus: str = CORPUS, bpe_json: str | None = None) -> list[str]:
    """The tokens of raw ``text`` as the corpus's training data has them: Multi30K's (:func:`tokenize`), or WMT'14's
    Moses tokens split into the BPE units of ``bpe_json``."""
    if corpus != "wmt14":
        return tokenize(text, lang)
    from .wmt14 import moses_tokenize

    if bpe_json is None:
        raise DataError("translating WMT'14 text needs its BPE model (bpe.json in the run folder or the corpus)")
    if not text.strip():
        return []
    return _bpe(bpe_json).apply([moses_tokenize(text, lang)])[0].split()


_BPE_MODELS: dict[str, object] = {}


def _bpe(bpe_json: str):  # noqa: ANN202 - a wmt14.Bpe, imported lazily
    """The BPE model of ``bpe_json``, parsed once per process."""
    from .wmt14 import Bpe

    if bpe_json not in _BPE_MODELS:
        _BPE_MODELS.clear()  # one model at a time: a run translates with its own
        _BPE_MODELS[bpe_json] = Bpe(bpe_json)
    return _BPE_MODELS[bpe_json]


def text_of(tokens: Sequence[str], lang: str, corpus: str = CORPUS) -> str:
    """Readable text from a translation's tokens: :func:`detokenize` for Multi30K, BPE units joined and Moses
    detokenised for WMT'14."""
    if corpus != "wmt14":
        return detokenize(tokens, lang)
    from .wmt14 import detokenize as detokenize_units

    return detokenize_units(tokens, lang)


def bleu_is_lowercase(corpus: str) -> bool:
    """Whether BLEU ignores case: on Multi30K, whose models read lower-cased text; not on WMT'14 (cased)."""
    return corpus != "wmt14"


# ---------------------------------------------------------------------------------------------
# Files


def check_pair(src_lang: str, tgt_lang: str, corpus: str = CORPUS) -> None:
    """Raise a one-line :class:`DataError` unless ``src_lang -> tgt_lang`` is a pair the corpus has."""
    if (src_lang, tgt_lang) not in PAIRS:
        available = ", ".join(f"{s}→{t}" for s, t in PAIRS)
        raise DataError(
            f"{corpus} has no {src_lang}→{tgt_lang} pair; available pairs: {available} "
            "(set translation.src_lang and translation.tgt_lang)"
        )


def tok_file(split: str, lang: str) -> str:
    return f"multi30k/tok/{SPLIT_FILES[split]}.lc.norm.tok.{lang}"


def raw_file(split: str, lang: str) -> str:
    return f"multi30k/{SPLIT_FILES[split]}.{lang}"


def multi30k_spec(src_lang: str, tgt_lang: str) -> CorpusSpec:
    """The files one translation direction needs: tokenised train/valid/test of both sides, and the
    raw valid/test references of the target side."""
    check_pair(src_lang, tgt_lang)
    files = (*_tok_files((src_lang, tgt_lang)), *_raw_references((tgt_lang,)))
    return CorpusSpec(CORPUS, "word", "bleu", f"Multi30K {src_lang}→{tgt_lang} (WMT16 multimodal task 1)",
                      "multi30k", files)


def multi30k_download_spec() -> CorpusSpec:
    """Every file either direction needs (``gatedformer data fetch multi30k``): the tokenised splits of both
    languages and the raw validation and test references of both."""
    languages = tuple(dict.fromkeys(lang for pair in PAIRS for lang in pair))
    files = (*_tok_files(languages), *_raw_references(languages))
    return CorpusSpec(CORPUS, "word", "bleu", "Multi30K en↔de (WMT16 multimodal task 1)", "multi30k", files)


def _pinned(rel: str) -> tuple[str | None, int | None]:
    sha = MULTI30K_SHA256.get(rel)
    return sha, MULTI30K_BYTES.get(sha) if sha else None


def _tok_files(languages: Sequence[str]) -> tuple[FileSpec, ...]:
    return tuple(FileSpec(rel, split, *_pinned(rel)[:1], f"{_MULTI30K_BASE}/tok/{Path(rel).name}", _pinned(rel)[1])
                 for split in SPLIT_FILES for lang in languages for rel in (tok_file(split, lang),))


def _raw_references(languages: Sequence[str]) -> tuple[FileSpec, ...]:
    return tuple(FileSpec(rel, split, *_pinned(rel)[:1], f"{_MULTI30K_BASE}/raw/{Path(rel).name}.gz",
                          _pinned(rel)[1], gzipped=True)
                 for split in ("valid", "test") for lang in languages for rel in (raw_file(split, lang),))


def locate_multi30k(src_lang: str, tgt_lang: str, data_dir: str | Path | None = None) -> tuple[Path, CorpusSpec]:
    """The data root holding every file of the pair (searched like every corpus), and its spec."""
    spec = multi30k_spec(src_lang, tgt_lang)
    candidates = data_dir_candidates(data_dir)
    for root in candidates:
        if holds(root, spec):
            return root, spec
    switch = offline_switch()
    if switch is None:  # fetched on first use, as every corpus with a download address is
        root = fetch_missing(CORPUS, data_dir, candidates)
        if root is not None and holds(root, spec):
            return root, spec
    partial = next((r for r in candidates if any(find_file(r, f.candidates) for f in spec.files)), None)
    if partial is not None:
        absent = next(f for f in spec.files if find_file(partial, f.candidates) is None)
        where = str(partial / absent.path)
    else:
        where = f"{tok_file('train', src_lang)} and the other {CORPUS} files"
    dirs = ", ".join(str(p) for p in candidates)
    fix = ("pass --data-dir, set GATEDFORMER_DATA to the folder holding multi30k/, or run `gatedformer data fetch "
           "multi30k`")
    if switch is not None:
        fix = (f"{switch} keeps it from being fetched on first use: run `gatedformer data fetch multi30k` where there "
               "is a network, pass --data-dir, or set GATEDFORMER_DATA to the folder holding multi30k/")
    raise DataError(f"corpus {CORPUS!r} not found: missing {where} (data dirs searched: {dirs}); {fix}")


def _read_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not valid UTF-8 (byte offset {err.start}); restore the original file") from None
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror or err}); check that it exists and is readable") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


# ---------------------------------------------------------------------------------------------
# Vocabulary


def build_vocab(sentences: Sequence[Sequence[str]], min_freq: int = 2, max_size: int = 0) -> Vocab:
    """``<unk> <pad> <bos> <eos>`` then every token seen ``min_freq`` times, most frequent first
    (ties alphabetical); ``max_size`` > 0 caps the whole vocabulary, specials included."""
    counts = Counter(token for sentence in sentences for token in sentence)
    for special in SPECIALS:
        counts.pop(special, None)
    kept = sorted((t for t, c in counts.items() if c >= max(min_freq, 1)), key=lambda t: (-counts[t], t))
    if max_size > 0:
        kept = kept[: max(max_size - len(SPECIALS), 0)]
    return Vocab((*SPECIALS, *kept), kind="word")


def encode(tokens: Sequence[str], vocab: Vocab) -> list[int]:
    stoi = vocab.stoi
    return [stoi.get(t, UNK_ID) for t in tokens]


def decode_ids(ids: Sequence[int], vocab: Vocab) -> list[str]:
    """Tokens of ``ids`` up to the first ``<eos>``, skipping ``<bos>`` and ``<pad>``."""
    tokens = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (BOS_ID, PAD_ID):
            tokens.append(vocab.itos[i])
    return tokens


# ---------------------------------------------------------------------------------------------
# Splits


@dataclass
class ParallelSplit:
    """One split: source and target token ids (no ``<bos>``/``<eos>``), and raw references for BLEU."""

    name: str
    src: list[list[int]]
    tgt: list[list[int]]
    references: list[str] = field(default_factory=list)
    skipped: int = 0
    """Training pairs left out because a side was empty or longer than n - 2 tokens."""
    truncated: int = 0
    """Evaluation sentences cut to n - 2 tokens."""

    def __len__(self) -> int:
        return len(self.src)


@dataclass
class TranslationData:
    """Both vocabularies and the three splits of one translation direction."""

    corpus: str
    src_lang: str
    tgt_lang: str
    src_vocab: Vocab
    tgt_vocab: Vocab
    train: ParallelSplit
    valid: ParallelSplit
    test: ParallelSplit
    root: Path
    bpe_json: str | None = None
    """The joint BPE model of a subword corpus (WMT'14), which new text is split with; ``None`` for Multi30K."""


def load_translation_data(src_lang: str = "en", tgt_lang: str = "de", data_dir: str | Path | None = None, *,
                          min_freq: int = 2, max_len: int = 128, src_vocab_size: int = 0, tgt_vocab_size: int = 0,
                          train_sentences: int = 0, corpus: str = CORPUS, shared_vocab: bool = False
                          ) -> TranslationData:
    """Locate and verify the files, build the vocabularies from the training split, encode every split.

    ``train_sentences`` > 0 keeps only the first that many training pairs (vocabulary included). ``shared_vocab``
    builds one vocabulary from both sides' training sentences (of ``src_vocab_size`` tokens when capped) and uses it
    for both.
    """
    if corpus not in CORPORA:
        raise DataError(f"unknown translation corpus {corpus!r}; use data.corpus={' or '.join(CORPORA)}")
    check_pair(src_lang, tgt_lang, corpus)
    if max_len < 3:
        raise DataError(f"translation.max_len={max_len} leaves no room for a token between <bos> and <eos>; "
                        "raise it")
    files = _wmt14_files(tgt_lang, data_dir) if corpus == "wmt14" else _multi30k_files(src_lang, tgt_lang, data_dir)
    root = files.root

    def tokens(split: str, lang: str) -> list[list[str]]:
        return [line.split() for line in _read_lines(files.tokens(split, lang))]

    train_src, train_tgt = tokens("train", src_lang), tokens("train", tgt_lang)
    _check_aligned(train_src, train_tgt, files.tokens("train", src_lang), files.tokens("train", tgt_lang))
    if train_sentences > 0:
        train_src, train_tgt = train_src[:train_sentences], train_tgt[:train_sentences]
    if shared_vocab:
        src_vocab = tgt_vocab = build_vocab([*train_src, *train_tgt], min_freq, src_vocab_size)
    else:
        src_vocab = build_vocab(train_src, min_freq, src_vocab_size)
        tgt_vocab = build_vocab(train_tgt, min_freq, tgt_vocab_size)

    longest = max_len - 2
    train = ParallelSplit("train", [], [])
    for s, t in zip(train_src, train_tgt, strict=True):
        if not s or not t or len(s) > longest or len(t) > longest:
            train.skipped += 1
            continue
        train.src.append(encode(s, src_vocab))
        train.tgt.append(encode(t, tgt_vocab))
    if not train.src:
        raise DataError(f"no training pair of {corpus} fits translation.max_len={max_len}; raise it")

    def evaluation(split: str) -> ParallelSplit:
        src, tgt = tokens(split, src_lang), tokens(split, tgt_lang)
        references, reference_file = files.references(split, tgt)
        _check_aligned(src, tgt, files.tokens(split, src_lang), files.tokens(split, tgt_lang))
        _check_aligned(src, references, files.tokens(split, src_lang), reference_file)
        out = ParallelSplit(split, [], [], references)
        for s, t in zip(src, tgt, strict=True):
            if len(s) > longest or len(t) > longest:
                out.truncated += 1
            out.src.append(encode(s[:longest], src_vocab))
            out.tgt.append(encode(t[:longest], tgt_vocab))
        if out.truncated:
            warnings.warn(f"{out.truncated} {split} sentence(s) of {corpus} are longer than translation.max_len="
                          f"{max_len} allows and were truncated to {longest} tokens", stacklevel=3)
        return out

    return TranslationData(corpus, src_lang, tgt_lang, src_vocab, tgt_vocab, train, evaluation("valid"),
                           evaluation("test"), root, files.bpe_json)


@dataclass
class _Files:
    """Where a corpus keeps each split's tokens, and its references."""

    root: Path
    tokens: Callable[[str, str], Path]
    """``(split, lang)`` -> the file of that split's tokens, one sentence a line."""
    references: Callable[[str, list[list[str]]], tuple[list[str], Path]]
    """``(split, target tokens)`` -> the split's raw target sentences, and where they come from."""
    bpe_json: str | None = None


def _multi30k_files(src_lang: str, tgt_lang: str, data_dir: str | Path | None) -> _Files:
    root, spec = locate_multi30k(src_lang, tgt_lang, data_dir)
    paths = {}
    for fspec in spec.files:
        path = find_file(root, fspec.candidates)
        assert path is not None  # locate_multi30k checked
        verify_file(path, fspec, root, CORPUS)
        paths[fspec.path] = path

    def references(split: str, tokens: list[list[str]]) -> tuple[list[str], Path]:
        path = paths[raw_file(split, tgt_lang)]
        return _read_lines(path), path

    return _Files(root, lambda split, lang: paths[tok_file(split, lang)], references)


def _wmt14_files(tgt_lang: str, data_dir: str | Path | None) -> _Files:
    from . import wmt14

    root = wmt14.locate_wmt14(data_dir)
    wmt14.verify_prepared(root)
    folder = root / wmt14.FOLDER

    def references(split: str, tokens: list[list[str]]) -> tuple[list[str], Path]:
        if split == "test":
            path = folder / f"test.ref.{tgt_lang}"
            return _read_lines(path), path
        # the held-out training pairs have no raw text: their references are their detokenised units
        return [wmt14.detokenize(units, tgt_lang) for units in tokens], folder / f"valid.{tgt_lang}"

    bpe = (folder / "bpe.json").read_text(encoding="utf-8")
    return _Files(root, lambda split, lang: folder / f"{split}.{lang}", references, bpe)


def _check_aligned(a: Sequence, b: Sequence, path_a: Path, path_b: Path) -> None:
    if len(a) != len(b):
        raise DataError(f"{path_a} has {len(a)} lines but {path_b} has {len(b)}; the parallel files must be "
                        "aligned line by line — restore the original files")


# ---------------------------------------------------------------------------------------------
# Batching


def length_batches(split: ParallelSplit, batch_size: int, max_tokens: int = 0, seed: int = 0, epoch: int = 0,
                   shuffle: bool = True) -> list[list[int]]:
    """Sentence indices grouped into batches of similar length.

    Sentences are sorted by length (ties in a random order) and cut into batches of ``batch_size``
    sentences, or, with ``max_tokens`` > 0, of at most ``max_tokens`` padded tokens (a batch holds at
    least one sentence). With ``shuffle`` the tie order and the batch order are drawn from
    ``(seed, epoch)`` alone, so an epoch's batches can be rebuilt exactly on resume.
    """
    n = len(split)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))

    def length(i: int) -> int:
        return max(len(split.src[i]), len(split.tgt[i])) + 1

    order.sort(key=length)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        size = length(i)
        full = (max(longest, size) * (len(current) + 1) > max_tokens) if max_tokens > 0 else len(current) >= batch_size
        if current and full:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, size)
    if current:
        batches.append(current)
    if shuffle:
        batches = [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def source_batch(sources: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(B, S)`` source ids: ``tokens <eos>``, right-padded."""
    return _pad([[*s, EOS_ID] for s in sources])


def collate(split: ParallelSplit, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, tgt_in, tgt_out)`` for sentences ``indices``: ``tokens <eos>``, ``<bos> tokens``, ``tokens <eos>``."""
    src = source_batch([split.src[i] for i in indices])
    tgt_in = _pad([[BOS_ID, *split.tgt[i]] for i in indices])
    tgt_out = _pad([[*split.tgt[i], EOS_ID] for i in indices])
    return src, tgt_in, tgt_out
