"""The GLUE tasks of the EAU/GRC paper (Table 2): their files, as GLUE distributes them, and a loader that gets every
quirk of the format right.

Each task is a corpus ``glue-<task>`` (``glue-cola``, ``glue-sst2``, ``glue-mrpc``, ``glue-stsb``, ``glue-rte``,
``glue-wnli``, ``glue-qnli``) of three files under ``glue/<TASK>/``: ``train.tsv``, ``dev.tsv`` (the validation
split) and ``test.tsv`` (no labels; an ``index`` column for the submission file). The format, as the files are:

* fields are separated by tabs and nothing else: quote characters are text (MRPC, RTE, STS-B and WNLI have fields
  that start with ``"``, and a quote-aware reader merges rows);
* rows end at ``\\n`` only (never at U+0085 or other characters Python's ``splitlines`` takes for line ends);
* ``CoLA/train.tsv`` and ``CoLA/dev.tsv`` have no header (source, label, author's mark, sentence), and ``dev.tsv``
  does not end with a newline;
* ``MRPC/train.tsv`` and ``MRPC/dev.tsv`` begin with a UTF-8 byte-order mark;
* every file is UTF-8.

A row that does not fit (another number of fields, a label outside the task's) is one :class:`DataError` naming the
file and the line. Files are verified against their SHA-256 like every corpus's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from .paths import find_file, locate
from .registry import CorpusSpec, FileSpec
from .verify import verify_file

__all__ = ["GLUE_CORPORA", "GLUE_TASKS", "SCORE_RANGE", "GlueExample", "GlueSplit", "GlueTask", "glue_task",
           "load_glue", "read_rows"]

_GLUE_BASE = "https://dl.fbaipublicfiles.com/glue/data"


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its files are, how their columns read, its labels and its metric."""

    name: str
    """What ``gatedformer finetune --task`` calls it (``cola``)."""
    folder: str
    """Its folder under ``glue/`` and the name GLUE gives it (``CoLA``)."""
    header: bool
    """Whether ``train.tsv`` and ``dev.tsv`` start with a header line."""
    columns: tuple[int, int | None, int]
    """The sentence, the second sentence (``None`` for single-sentence tasks) and the label, in train and dev."""
    test_columns: tuple[int, int | None]
    """The sentence and the second sentence in ``test.tsv`` (its column 0 is the ``index``)."""
    labels: tuple[str, ...] | None
    """The labels as the files write them, in the order of the model's outputs; ``None``: a score (regression)."""
    metric: str
    """The metric the paper reports: ``accuracy``, ``matthews`` (CoLA) or ``pearson_spearman`` (STS-B)."""
    epochs: int
    """The paper's fine-tuning epochs (3; CoLA 5, RTE 8)."""
    title: str

    @property
    def corpus(self) -> str:
        return f"glue-{self.name}"

    @property
    def regression(self) -> bool:
        return self.labels is None

    @property
    def submission(self) -> str:
        """The file name GLUE's submission server expects for the test predictions."""
        return f"{self.folder}.tsv"


SCORE_RANGE = (0.0, 5.0)
"""The scale of a regression task's scores (STS-B's similarity, 0 to 5)."""

GLUE_TASKS: dict[str, GlueTask] = {task.name: task for task in (
    GlueTask("cola", "CoLA", False, (3, None, 1), (1, None), ("0", "1"), "matthews", 5,
             "CoLA (linguistic acceptability)"),
    GlueTask("sst2", "SST-2", True, (0, None, 1), (1, None), ("0", "1"), "accuracy", 3, "SST-2 (sentiment)"),
    GlueTask("mrpc", "MRPC", True, (3, 4, 0), (3, 4), ("0", "1"), "accuracy", 3, "MRPC (paraphrase)"),
    GlueTask("stsb", "STS-B", True, (7, 8, 9), (7, 8), None, "pearson_spearman", 3, "STS-B (similarity)"),
    GlueTask("rte", "RTE", True, (1, 2, 3), (1, 2), ("entailment", "not_entailment"), "accuracy", 8,
             "RTE (entailment)"),
    GlueTask("wnli", "WNLI", True, (1, 2, 3), (1, 2), ("0", "1"), "accuracy", 3, "WNLI (Winograd NLI)"),
    GlueTask("qnli", "QNLI", True, (1, 2, 3), (1, 2), ("entailment", "not_entailment"), "accuracy", 3,
             "QNLI (question NLI)"),
)}
"""The paper's seven GLUE tasks, in its Table 2's order of columns' tasks as ``finetune.tasks`` lists them."""

# (sha256, bytes) of every file, as shared/data/README.md lists them; QNLI is checked by its archive's hash.
_FACTS: dict[str, dict[str, tuple[str, int]]] = {
    "CoLA": {"train": ("cb368ebeb9f27d7ad03720d27ddc95687a311bdb100781a2fe59a5f5b1bc0624", 428_590),
             "dev": ("8c013e21dc39957cac37378d87bebe225b694a0d5fe13eded66c2856628833fd", 53_717),
             "test": ("3b4df85f7a9a0633574b38d181e18090ac961a24b18fb6bcd74999ddea8ad0b8", 48_788)},
    "SST-2": {"train": ("48eac26399f8456935f81dd9e3a745c1430adb6c62e233ccfe22db4a0d15d1d1", 3_806_081),
              "dev": ("54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0", 94_931),
              "test": ("69a938605609b3e6663b4487918fe1565eb293734e6e520d0366d1d412fd2a13", 197_335)},
    "MRPC": {"train": ("69abcedee3cf738c6ce58d772e43e1b7cdf5b4edee4aceda459c0d9f4e5599f3", 941_471),
             "dev": ("9e8f284788040f7c9ecde2e1b3c07237c756f926bd9ef8548ef5d34b56f69f17", 105_616),
             "test": ("aee460ceda833926b8ab2ad952d399f5cf8bc9335cff19afcac03dc449558622", 445_335)},
    "STS-B": {"train": ("41c4d978b6162abdcada7e49a982211954cca5459c228db478af333124b257a2", 984_099),
              "dev": ("fe7dc0632a5033562f3cadff991f6e8d9b9b6311861660e78c3c82eb7db67f59", 276_928),
              "test": ("16b4223d7d44a644fbc10f1b449472cfe81e1715fb07cf44023b0aa88ce856eb", 292_587)},
    "RTE": {"train": ("41e3a9b063433392343fad9e962cf2f58b681c78d8f71592f4186f0837246c5c", 846_226),
            "dev": ("80230dfa1347282e7b532b06a1004a76a710087541189bf874223ddf0e3819fb", 90_343),
            "test": ("6e33f09b5c2bfd5fd5fde217070f3dd49e484e33b9752b5864cf36fc421a213f", 933_969)},
    "WNLI": {"train": ("9a88e9d54b6861cc796a088e9acf4f5f65064a9ef65ae6fa7a688b28391e5c9a", 99_411),
             "dev": ("cba00490596dd14be8cf53b4f53bb744abe3a7b89f81ab210528d80225338ed5", 11_261),
             "test": ("ff0296817e235bf6f7a230c5f6781bd6ee228a45445f6510831fdef6f2a04766", 35_761)},
}
# GLUE's archives (https://dl.fbaipublicfiles.com/glue/data/<name>.zip) hold <folder>/<file>; only QNLIv2.zip's own
# hash is published (TFDS), the other archives are checked by their members' hashes above.
_ARCHIVES = {"CoLA": ("CoLA.zip", None), "SST-2": ("SST-2.zip", None), "STS-B": ("STS-B.zip", None),
             "RTE": ("RTE.zip", None), "WNLI": ("WNLI.zip", None),
             "QNLI": ("QNLIv2.zip", "e634e78627a29adaecd4f955359b22bf5e70f2cbd93b493f2d624138a0c0e5f5")}
SPLIT_FILES = {"train": "train", "valid": "dev", "test": "test"}


def _spec(task: GlueTask) -> CorpusSpec:
    facts = _FACTS.get(task.folder, {})
    archive, archive_sha256 = _ARCHIVES.get(task.folder, (None, None))
    files = []
    for split, stem in SPLIT_FILES.items():
        sha256, size = facts.get(stem, (None, None))
        path = f"glue/{task.folder}/{stem}.tsv"
        if archive is None:  # MRPC: GLUE does not host it; `data fetch` builds it from its sources
            files.append(FileSpec(path, split, sha256, None, size))
        else:
            files.append(FileSpec(path, split, sha256, f"{_GLUE_BASE}/{archive}", size,
                                  member=f"{task.folder}/{stem}.tsv", archive_sha256=archive_sha256))
    return CorpusSpec(task.corpus, "sentence", task.metric, f"GLUE {task.title}: train, dev and (unlabelled) test",
                      "glue", tuple(files))


GLUE_CORPORA: dict[str, CorpusSpec] = {task.corpus: _spec(task) for task in GLUE_TASKS.values()}


def glue_task(name: str) -> GlueTask:
    """The task ``name`` (``cola``) or corpus ``glue-cola`` names; a :class:`DataError` listing them otherwise."""
    key = name.strip().lower().removeprefix("glue-").replace("-", "")
    if key not in GLUE_TASKS:
        raise DataError(f"unknown GLUE task {name!r}; the tasks are {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]


@dataclass(frozen=True)
class GlueExample:
    """One row: its number in the file (0-based, the header not counted), text(s) and label."""

    index: int
    text_a: str
    text_b: str | None
    label: int | float | None
    """The label's position in :attr:`GlueTask.labels`, the score (STS-B) or ``None`` (test)."""


@dataclass(frozen=True)
class GlueSplit:
    task: GlueTask
    split: str
    examples: tuple[GlueExample, ...]

    def __len__(self) -> int:
        return len(self.examples)


def read_rows(path: Path, header: bool, fix: str) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """The header's fields and every row's (line number, fields) of a tab-separated file as GLUE writes them: UTF-8
    (a byte-order mark dropped), rows ending at ``\\n`` (a ``\\r`` before it dropped), fields split at tabs only."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 (byte offset {err.start}); {fix}") from None
    text = text.removeprefix("\ufeff")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    rows = [(number, line.removesuffix("\r").split("\t")) for number, line in enumerate(lines, start=1)]
    if not header:
        return None, rows
    if not rows:
        raise DataError(f"{path} is empty; {fix}")
    return rows[0][1], rows[1:]


def _examples(task: GlueTask, path: Path, split: str, fix: str) -> tuple[GlueExample, ...]:
    labelled = split != "test"
    names, rows = read_rows(path, task.header or not labelled, fix)
    width = len(names) if names is not None else 4  # CoLA's headerless files: source, label, mark, sentence
    a, b, label = task.columns if labelled else (*task.test_columns, None)
    examples = []
    for number, (line, fields) in enumerate(rows):
        if len(fields) != width:
            raise DataError(f"{path} line {line}: {len(fields)} tab-separated fields where the file has {width}; "
                            f"the file is damaged: {fix}")
        value: int | float | None = None
        if label is not None:
            value = _label(task, fields[label], path, line, fix)
        examples.append(GlueExample(number, fields[a], None if b is None else fields[b], value))
    if not examples:
        raise DataError(f"{path} holds no examples; {fix}")
    return tuple(examples)


def _label(task: GlueTask, text: str, path: Path, line: int, fix: str) -> int | float:
    if task.labels is None:
        try:
            score = float(text)
        except ValueError:
            score = float("nan")
        low, high = SCORE_RANGE
        if not low <= score <= high:
            raise DataError(f"{path} line {line}: score {text!r} is not a number in [{low:g}, {high:g}]; {fix}")
        return score
    if text not in task.labels:
        raise DataError(f"{path} line {line}: label {text!r} is not one of {', '.join(task.labels)}; {fix}")
    return task.labels.index(text)


def locate_glue(task: GlueTask, data_dir: str | Path | None = None) -> tuple[Path, dict[str, Path]]:
    """The data root holding the task's files (searched like every corpus's, each verified) and their paths."""
    spec = GLUE_CORPORA[task.corpus]
    root = locate(spec, data_dir)
    paths = {}
    for f in spec.files:
        path = find_file(root, f.candidates)
        assert path is not None  # locate() checked
        verify_file(path, f, root, spec.name)
        paths[f.split] = path
    return root, paths


def load_glue(name: str, data_dir: str | Path | None = None) -> dict[str, GlueSplit]:
    """The ``train``, ``valid`` (GLUE's dev) and ``test`` splits of the task ``name``."""
    task = glue_task(name)
    _, paths = locate_glue(task, data_dir)
    fix = f"fetch it again with `gatedformer data fetch {task.corpus}`"
    try:
        return {split: GlueSplit(task, split, _examples(task, path, split, fix)) for split, path in paths.items()}
    except OSError as err:
        raise DataError(f"cannot read {err.filename} ({err.strerror or err}); check that it is readable") from None
