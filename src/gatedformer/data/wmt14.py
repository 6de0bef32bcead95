"""WMT'14 English–German for translation: fetched from its canonical archives, tokenised with Moses and joint BPE.

``gatedformer data fetch wmt14`` prepares the corpus the way fairseq's ``prepare-wmt14en2de.sh --icml17`` describes
(the true WMT'14 training data; we write our own pipeline with ``sacremoses`` and the ``tokenizers`` library):

1. **Archives**, from their canonical addresses (:data:`ARCHIVES`; with ``--mirror URL`` from
   ``URL/wmt14/archives/<file>``), each checked against its published checksum before anything is read from it
   (SHA-256 where one is published, MD5 for ``test-full.tgz``, for which that is all there is) and kept under
   ``wmt14/archives/`` so that preparing again downloads nothing: Europarl v7, Common Crawl and News Commentary v9
   for training, ``newstest2014`` (the full 3,003 segments, as fairseq uses) for testing.
2. **Moses tokenisation** of every side (``sacremoses``: punctuation normalised, non-printing characters removed,
   ``-a`` aggressive hyphen splitting, the Moses escapes), no lower-casing. The test set's SGML is read segment by
   segment.
3. **Validation**: every 100th training pair is held out (fairseq's default), the rest is training.
4. **Joint BPE** of :data:`BPE_SIZE` units learned on both sides of the training split (``tokenizers``' BPE trainer on
   whitespace-split words, ``</w>`` marking word ends), applied to every split and written in subword-nmt's
   convention: a unit that does not end its word carries ``@@``.
5. **Cleaning** of the training pairs as Moses' ``clean-corpus-n.perl 1 250 -ratio 1.5``: a side empty or over 250
   units, or one side over 1.5 times the other's length, drops the pair.

Files, under ``wmt14/`` of the data root: ``{train,valid,test}.{en,de}`` (BPE units, one sentence a line),
``test.ref.de`` and ``test.ref.en`` (the raw references for SacreBLEU), ``bpe.json`` (the BPE model, which a run keeps
to translate new text) and ``PREPARED.json``: how they were made and the SHA-256 of each, written last, so a corpus
without it is an unfinished one, and every load checks the files against it.

BLEU is SacreBLEU's, case-sensitive, of the detokenised output (BPE joined, Moses detokenised) against the raw
references (the validation pairs' references are their detokenised text).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import html
import json
import os
import re
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gatedformer.io import FolderLock, publish

from ..errors import DataError, InUseError, OutputError
from .archives import download
from .paths import data_dir_candidates, fetch_missing, fetch_target_dir, offline_switch
from .registry import CorpusSpec, FileSpec

__all__ = ["ARCHIVES", "BPE_SIZE", "CORPUS", "Archive", "Bpe", "detokenize", "fetch_wmt14", "locate_wmt14",
           "moses_tokenize", "prepared_files"]

CORPUS = "wmt14"
FOLDER = "wmt14"
PIPELINE = 1
"""The version of the preparation below: a corpus prepared by another is prepared again."""
BPE_SIZE = 40_000
"""Joint BPE units (fairseq's prepare-wmt14en2de.sh learns 40,000 merges)."""
MAX_UNITS, MAX_RATIO, VALID_EVERY = 250, 1.5, 100
PAIR = ("en", "de")
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Archive:
    """One downloaded archive, and the members read from it per language."""

    file: str
    url: str
    members: dict[str, str]
    split: str
    """``train`` (parallel text, one sentence a line) or ``test`` (SGML, one ``<seg>`` a sentence)."""
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None


# Mutable on purpose: tests point it at small stand-in archives on a local server.
ARCHIVES: dict[str, Archive] = {
    "europarl": Archive(
        "training-parallel-europarl-v7.tgz", "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
        {"en": "training/europarl-v7.de-en.en", "de": "training/europarl-v7.de-en.de"}, "train",
        sha256="0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7", size=657_632_379),
    "commoncrawl": Archive(
        "training-parallel-commoncrawl.tgz", "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
        {"en": "commoncrawl.de-en.en", "de": "commoncrawl.de-en.de"}, "train",
        sha256="c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5", size=918_311_367),
    "news-commentary": Archive(
        "training-parallel-nc-v9.tgz", "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
        {"en": "training/news-commentary-v9.de-en.en", "de": "training/news-commentary-v9.de-en.de"}, "train",
        sha256="cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485", size=80_418_416),
    "newstest2014": Archive(
        "test-full.tgz", "http://statmt.org/wmt14/test-full.tgz",
        {"en": "test-full/newstest2014-deen-src.en.sgm", "de": "test-full/newstest2014-deen-ref.de.sgm"}, "test",
        md5="a8cd784e006feb32ac6f3d9ec7eb389a"),
}
ARCHIVE_LIMIT = 1 << 31
"""The most bytes an archive without a known size may bring."""


def wmt14_spec() -> CorpusSpec:
    """The prepared files as a corpus spec (for ``data list`` and ``data check``; their checksums are the ones
    ``PREPARED.json`` records, which :func:`verify_prepared` checks)."""
    files = tuple(FileSpec(relative, relative.split("/")[1].split(".")[0] if "/bpe" not in relative else "all",
                           None, None) for relative in [*prepared_files(), f"{FOLDER}/PREPARED.json"])
    return CorpusSpec(CORPUS, "word", "bleu", "WMT'14 English→German (Europarl v7, Common Crawl, News Commentary v9; "
                      "newstest2014), Moses-tokenised, 40k joint BPE (`gatedformer data fetch wmt14`)", CORPUS, files)


def prepared_files() -> list[str]:
    """The prepared files, relative to the data root (``PREPARED.json`` holds their checksums)."""
    names = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in PAIR]
    return [f"{FOLDER}/{name}" for name in (*names, "test.ref.en", "test.ref.de", "bpe.json")]


def _needs(module: str) -> DataError:
    return DataError(f"WMT'14 needs {module}; install it with pip install 'gatedformer[translate]'")


# ---------------------------------------------------------------------------------------------------------------
# Tokenisation


_MOSES: dict[str, tuple] = {}


def _moses(lang: str) -> tuple:
    if lang not in _MOSES:
        try:
            from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer
        except ImportError:
            raise _needs("sacremoses") from None
        _MOSES[lang] = (MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang), MosesDetokenizer(lang=lang))
    return _MOSES[lang]


def moses_tokenize(text: str, lang: str) -> str:
    """One line as fairseq's Moses steps leave it: punctuation normalised, non-printing characters (Unicode's ``C``
    categories, as remove-non-printing-char.perl) turned into spaces, tokens split with aggressive hyphen splitting
    and escaped, joined by single spaces."""
    import regex  # sacremoses' own dependency: Python's re has no Unicode categories

    normalizer, tokenizer, _ = _moses(lang)
    text = regex.sub(r"\p{C}", " ", normalizer.normalize(text))
    return tokenizer.tokenize(text, aggressive_dash_splits=True, return_str=True, escape=True)


def _tokenize_chunk(args: tuple[list[str], str]) -> list[str]:
    lines, lang = args
    return [moses_tokenize(line, lang) for line in lines]


def _tokenize_all(lines: Sequence[str], lang: str, workers: int) -> list[str]:
    """:func:`moses_tokenize` of every line, in ``workers`` processes for a large corpus."""
    if workers <= 1 or len(lines) < 20_000:
        return _tokenize_chunk((list(lines), lang))
    size = 5_000
    chunks = [(list(lines[i: i + size]), lang) for i in range(0, len(lines), size)]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return [line for part in pool.map(_tokenize_chunk, chunks) for line in part]


def detokenize(units: Sequence[str], lang: str) -> str:
    """Readable text from BPE units: ``@@`` joins, Moses' detokeniser undoes the tokenisation and the escapes."""
    words = " ".join(units).replace("@@ ", "").removesuffix("@@").split()
    return _moses(lang)[2].detokenize(words, unescape=True)


class Bpe:
    """The joint BPE model (``tokenizers``), applied to Moses-tokenised text in subword-nmt's ``@@`` convention."""

    SUFFIX = "</w>"

    def __init__(self, model_json: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise _needs("the tokenizers library") from None
        try:
            self.tokenizer = Tokenizer.from_str(model_json)
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception types for a bad file
            raise DataError(f"the BPE model (bpe.json) is damaged ({str(err)[:80]}); delete it and fetch wmt14 "
                            "again") from None
        self.json = model_json

    @classmethod
    def learn(cls, files: Sequence[Path], size: int = BPE_SIZE) -> Bpe:
        """Learn ``size`` units jointly on the whitespace-split words of ``files``."""
        try:
            from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        except ImportError:
            raise _needs("the tokenizers library") from None
        tokenizer = Tokenizer(models.BPE(end_of_word_suffix=cls.SUFFIX))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.BpeTrainer(vocab_size=size, end_of_word_suffix=cls.SUFFIX, show_progress=False)
        tokenizer.train([str(f) for f in files], trainer)
        return cls(tokenizer.to_str())

    def apply(self, lines: Sequence[str]) -> list[str]:
        """The BPE units of each Moses-tokenised line, ``@@`` on every unit but a word's last. A character the model
        never saw stays, as a unit of its own (``tokenizers`` would drop it; subword-nmt keeps it), so no text is lost:
        the vocabulary then reads it as ``<unk>``."""
        out = []
        for line, encoding in zip(lines, self.tokenizer.encode_batch(list(lines)), strict=True):
            units = self._units(encoding.tokens)
            if "".join(unit.removesuffix("@@") for unit in units) != "".join(line.split()):
                units = [unit for word in line.split() for unit in self._word(word)]
            out.append(" ".join(units))
        return out

    def _units(self, tokens: Sequence[str]) -> list[str]:
        return [unit[: -len(self.SUFFIX)] if unit.endswith(self.SUFFIX) else unit + "@@" for unit in tokens]

    def _word(self, word: str) -> list[str]:
        units = self._units(self.tokenizer.encode(word).tokens)
        if "".join(unit.removesuffix("@@") for unit in units) == word:
            return units
        return [*(char + "@@" for char in word[:-1]), word[-1]]  # the word has a character the model lacks


# ---------------------------------------------------------------------------------------------------------------
# Archives


def _digests(path: Path) -> tuple[str, str]:
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
    return sha.hexdigest(), md5.hexdigest()


def _mismatch(archive: Archive, sha: str, md5: str) -> str | None:
    """What is wrong with an archive of these digests, or ``None``."""
    if archive.sha256 is not None and sha != archive.sha256:
        return f"sha256 {sha[:16]}..., expected {archive.sha256[:16]}..."
    if archive.md5 is not None and md5 != archive.md5:
        return f"md5 {md5[:16]}..., expected {archive.md5[:16]}..."
    return None


def _archive_url(archive: Archive, mirror: str | None) -> str:
    if mirror:
        return f"{mirror.rstrip('/')}/{FOLDER}/archives/{urllib.parse.quote(archive.file)}"
    return archive.url


def _fetch_archive(archive: Archive, folder: Path, mirror: str | None, say: Callable[[str], None]) -> Path:
    """The archive in ``folder``, checked; downloaded (and checked before it is kept) where it is missing or bad."""
    target = folder / archive.file
    if target.is_file():
        if _mismatch(archive, *_digests(target)) is None:
            return target
        say(f"wmt14: {target} does not match its checksum; downloading it again")
    url = _archive_url(archive, mirror)
    say(f"wmt14: downloading {url}")
    fd, name = tempfile.mkstemp(dir=folder, prefix=f".{archive.file}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            sha, md5 = download(url, tmp, archive.size or ARCHIVE_LIMIT)
        except OSError as err:
            raise DataError(f"could not download {url} ({getattr(err, 'reason', None) or err.strerror or err}); "
                            f"nothing was saved; retry, place {archive.file} in {folder} by hand, or use a mirror "
                            "(--mirror URL)") from None
        wrong = _mismatch(archive, sha, md5)
        if wrong is not None:
            raise DataError(f"checksum mismatch for download {url}: {wrong}; nothing was saved; retry, or use a "
                            "mirror (--mirror URL)")
        publish(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


def _read_members(path: Path, members: dict[str, str]) -> dict[str, list[str]]:
    """The lines of each wanted member of a ``.tgz`` archive, by language (undecodable bytes replaced, as the
    parallel corpora hold a few)."""
    found: dict[str, list[str]] = {}
    wanted = {name: lang for lang, name in members.items()}
    try:
        with tarfile.open(path, "r:gz") as archive:
            for member in archive:
                lang = wanted.get(member.name.removeprefix("./"))
                if lang is None or not member.isfile():
                    continue
                handle = archive.extractfile(member)
                assert handle is not None
                text = handle.read().decode("utf-8", errors="replace")
                lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
                found[lang] = lines[:-1] if lines and lines[-1] == "" else lines
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{path} is not a readable .tgz archive ({err}); delete it and fetch wmt14 again") from None
    missing = [name for lang, name in members.items() if lang not in found]
    if missing:
        raise DataError(f"{path} holds no {', '.join(missing)}; delete it and fetch wmt14 again")
    return found


_SEGMENT = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)


def _segments(lines: Iterable[str]) -> list[str]:
    """The sentences of an SGML test file, one ``<seg>`` each, entities undone."""
    return [html.unescape(match.group(1)).strip().replace("’", "'") for line in lines
            for match in _SEGMENT.finditer(line)]


# ---------------------------------------------------------------------------------------------------------------
# Preparation


@dataclass
class _Prepared:
    texts: dict[str, str] = field(default_factory=dict)
    """Relative path -> content."""


def _clean(pairs: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """clean-corpus-n.perl 1 250 -ratio 1.5 on BPE units."""
    for src, tgt in pairs:
        a, b = len(src.split()), len(tgt.split())
        if 1 <= a <= MAX_UNITS and 1 <= b <= MAX_UNITS and a <= MAX_RATIO * b and b <= MAX_RATIO * a:
            yield src, tgt


def _prepare(archives: dict[str, Path], work: Path, bpe_size: int, workers: int,
             say: Callable[[str], None]) -> dict[str, str]:
    """Every prepared file's content, from the checked archives."""
    train: dict[str, list[str]] = {lang: [] for lang in PAIR}
    test: dict[str, list[str]] = {}
    for key, path in archives.items():
        archive = ARCHIVES[key]
        lines = _read_members(path, archive.members)
        if archive.split == "test":
            test = {lang: _segments(lines[lang]) for lang in PAIR}
            continue
        if len(lines["en"]) != len(lines["de"]):
            raise DataError(f"{path}: {archive.members['en']} has {len(lines['en'])} lines but "
                            f"{archive.members['de']} has {len(lines['de'])}; delete it and fetch wmt14 again")
        for lang in PAIR:
            train[lang] += lines[lang]
    if not test or len(test["en"]) != len(test["de"]) or not test["en"]:
        raise DataError("the newstest2014 files hold no aligned segments; delete test-full.tgz and fetch wmt14 again")
    say(f"wmt14: Moses-tokenising {len(train['en']):,} training pairs and {len(test['en']):,} test sentences")
    tokens = {lang: _tokenize_all(train[lang], lang, workers) for lang in PAIR}
    test_tokens = {lang: _tokenize_all(test[lang], lang, workers) for lang in PAIR}
    pairs = [(s, t) for s, t in zip(tokens["en"], tokens["de"], strict=True) if s.strip() and t.strip()]
    valid = [pair for i, pair in enumerate(pairs, start=1) if i % VALID_EVERY == 0]
    training = [pair for i, pair in enumerate(pairs, start=1) if i % VALID_EVERY != 0]
    say(f"wmt14: learning {bpe_size:,} joint BPE units")
    for index, lang in enumerate(PAIR):
        (work / f"train.tok.{lang}").write_text("".join(pair[index] + "\n" for pair in training), encoding="utf-8")
    bpe = Bpe.learn([work / f"train.tok.{lang}" for lang in PAIR], bpe_size)
    texts: dict[str, str] = {}
    for split, rows in (("train", training), ("valid", valid)):
        units = {lang: bpe.apply([pair[index] for pair in rows]) for index, lang in enumerate(PAIR)}
        kept = list(_clean(zip(units["en"], units["de"], strict=True))) if split == "train" else list(
            zip(units["en"], units["de"], strict=True))
        for index, lang in enumerate(PAIR):
            texts[f"{FOLDER}/{split}.{lang}"] = "".join(pair[index] + "\n" for pair in kept)
    for lang in PAIR:
        texts[f"{FOLDER}/test.{lang}"] = "".join(line + "\n" for line in bpe.apply(test_tokens[lang]))
        texts[f"{FOLDER}/test.ref.{lang}"] = "".join(line + "\n" for line in test[lang])
    texts[f"{FOLDER}/bpe.json"] = bpe.json
    return texts


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _write(root: Path, relative: str, text: str) -> None:
    target = root / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        publish(name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _manifest(root: Path) -> dict | None:
    path = root / FOLDER / "PREPARED.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("pipeline") != PIPELINE or not isinstance(record.get("files"), dict):
        return None
    return record


def fetch_wmt14(data_dir: str | Path | None = None, mirror: str | None = None, progress: bool = True,
                bpe_size: int = BPE_SIZE, workers: int | None = None) -> Path:
    """Download (where missing) and prepare WMT'14 en-de in the data root (see the module docstring); return the
    root. A corpus prepared already, whose files match ``PREPARED.json``, is left as it is."""
    root = fetch_target_dir(data_dir)
    say: Callable[[str], None] = (lambda message: print(message, flush=True)) if progress else (lambda message: None)
    if _manifest(root) is not None:
        try:
            verify_prepared(root)
            return root
        except DataError as err:
            say(f"wmt14: {err}; preparing it again")
    folder = root / FOLDER / "archives"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot write to {folder} ({err.strerror or err}); pass a writable --data-dir or set "
                        "GATEDFORMER_DATA") from None
    lock = FolderLock(root / FOLDER / ".gatedformer-fetch.lock", "fetch wmt14", remove=True)
    try:
        taken = lock.acquire()
    except OutputError as err:
        raise DataError(str(err)) from None
    if not taken:
        raise InUseError(f"{root / FOLDER} is being prepared by {lock.holder()}; wait for that fetch to end, then run "
                         "this one again")
    try:
        archives = {key: _fetch_archive(archive, folder, mirror, say) for key, archive in ARCHIVES.items()}
        with tempfile.TemporaryDirectory(dir=root / FOLDER, prefix=".prepare.") as work:
            texts = _prepare(archives, Path(work), bpe_size, workers or os.cpu_count() or 1, say)
        (root / FOLDER / "PREPARED.json").unlink(missing_ok=True)  # an unfinished corpus has none
        for relative, text in texts.items():
            _write(root, relative, text)
        record = {"pipeline": PIPELINE, "bpe_size": bpe_size, "valid_every": VALID_EVERY, "max_units": MAX_UNITS,
                  "max_ratio": MAX_RATIO, "archives": {key: ARCHIVES[key].file for key in archives},
                  "lines": {relative: text.count("\n") for relative, text in texts.items() if relative[-3] == "."},
                  "files": {relative: _sha256_text(text) for relative, text in texts.items()}}
        _write(root, f"{FOLDER}/PREPARED.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    finally:
        lock.release()
    say(f"wmt14: ready in {root / FOLDER} ({record['lines'][f'{FOLDER}/train.en']:,} training pairs)")
    return root


def verify_prepared(root: Path) -> dict:
    """``PREPARED.json`` of ``root``, once every prepared file matches its checksum there (a :class:`DataError`
    naming the first that does not)."""
    from .verify import sha256_file

    record = _manifest(root)
    if record is None:
        raise DataError(f"{root / FOLDER} holds no finished preparation (PREPARED.json); run "
                        "`gatedformer data fetch wmt14`")
    for relative in prepared_files():
        path, want = root / relative, record["files"].get(relative)
        if want is None or not path.is_file():
            raise DataError(f"{path} is missing; run `gatedformer data fetch wmt14` to prepare the corpus again")
        if _cached_sha256(path, sha256_file) != want:
            raise DataError(f"checksum mismatch for {path} (not as PREPARED.json records it); run `gatedformer data "
                            "fetch wmt14` to prepare it again")
    return record


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _cached_sha256(path: Path, sha256_file: Callable[[Path], str]) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = sha256_file(path)
    return _SHA_CACHE[key]


def locate_wmt14(data_dir: str | Path | None = None) -> Path:
    """The first data root holding a prepared WMT'14 (searched like every corpus)."""
    candidates = data_dir_candidates(data_dir)
    for root in candidates:
        if (root / FOLDER / "PREPARED.json").is_file():
            return root
    switch = offline_switch()
    if switch is None:  # fetched and prepared on first use, as every corpus with a download address is
        root = fetch_missing("wmt14", data_dir, candidates)
        if root is not None and (root / FOLDER / "PREPARED.json").is_file():
            return root
    kept = f"{switch} keeps it from being fetched on first use; " if switch else ""
    raise DataError(f"corpus 'wmt14' not found: no {FOLDER}/PREPARED.json in {', '.join(map(str, candidates))}; {kept}"
                    "run `gatedformer data fetch wmt14` (about 1.7 GB of archives), or pass --data-dir")
