"""Trained models in the Hugging Face Hub convention: :func:`load` a run, ``save_pretrained`` it as a folder of
``config.json``, ``model.safetensors``, the vocabulary or tokenizer files and a ``README.md`` model card, and
:func:`from_pretrained` such a folder (or a Hub repository holding one) back, bit for bit.

An exported folder is data, never code: its config is JSON read with a size bound and validated field by field, its
weights are safetensors checked against the SHA-256 they record (the run's own weights carry the same), and pickle
files (``pytorch_model.bin``, ``*.pt``...) are refused rather than read. Every damaged or hostile folder is one
:class:`~gatedformer.errors.GatedformerError` naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from gatedformer.config import RunConfig, config_from_dict, task_of
from gatedformer.data.verify import FILES_KEY, check_files, files_checksums
from gatedformer.devices import resolve_device
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError, InUseError, OutputError
from gatedformer.io import (
    FolderLock,
    atomic_write_text,
    input_lines,
    json_safe,
    make_folder,
    output_path,
    read_limited,
)
from gatedformer.runs import load_trained
from gatedformer.tasks import Task, get_task
from gatedformer.train.checkpoint import (
    EXPORT_FORMAT,
    check_architecture,
    load_model_weights,
    read_tensors,
    save_model_weights,
    weights_metadata,
)
from gatedformer.version import __version__

__all__ = ["FORMAT_VERSION", "Pretrained", "export_run", "from_pretrained", "load"]

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
EXPORT_LOCK = ".gatedformer-export.lock"
"""The lock an export holds on its folder while it writes it (deleted when it lets go)."""
_CONFIG_BYTES = 1 << 24
_PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


class Pretrained:
    """A trained model in the user's hands: its run config, task, network (``model``, in eval mode, on its device)
    and what it needs to read and write text (``data``: the vocabulary of a language model, the vocabularies of a
    translation model, the tokenizer of a BERT). Calling it calls the network."""

    def __init__(self, config: RunConfig, task: Task, model: nn.Module, data: Any,
                 results: dict[str, Any] | None = None, source: Path | None = None) -> None:
        self.config = config
        self.task = task
        self.model = model
        self.data = data
        self.results = results or {}
        """The run's ``results.json`` (its valid and test scores), as the model card shows them."""
        self.source = source

    def __repr__(self) -> str:
        return (f"Pretrained({self.task.name}, {self.config.model.backbone}, gates={self.config.model.gates!r}, "
                f"corpus={self.config.data.corpus!r}, device={self.device})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> Pretrained:
        """Move the network to ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``...); returns ``self``."""
        self.model.to(resolve_device(str(device)))
        return self

    # ---- using it --------------------------------------------------------------------------------------------

    def _require(self, task: str, method: str) -> None:
        if self.task.name != task:
            raise ConfigError(f"{method}() needs a {get_task(task).title} model; this one is a {self.task.title} "
                              f"model ({self.config.data.corpus})")

    def generate(self, prompt: str = "", max_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                 seed: int = 0, context: int = 512, cache: bool = True) -> str:
        """Prompt plus ``max_tokens`` sampled tokens, as text (a language model; see
        :func:`gatedformer.tasks.lm.generate_stream`: ``cache=False`` recomputes the window for every token)."""
        return "".join(self.generate_stream(prompt, max_tokens, temperature, top_k, seed, context, cache))

    def generate_stream(self, prompt: str = "", max_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                        seed: int = 0, context: int = 512, cache: bool = True) -> Iterator[str]:
        """:meth:`generate`'s text piece by piece, as it is sampled."""
        from gatedformer.tasks.lm import generate_stream

        self._require("lm", "generate")
        return generate_stream(self.model, self.data.vocab, prompt, max_tokens, temperature, top_k, seed, context,
                               cache)

    def translate(self, text: str | Sequence[str], beam: int | None = None,
                  length_penalty: float | None = None) -> str | list[str]:
        """The translation of one sentence (a string) or of each of several (a list), with the run's beam search
        unless ``beam`` (1: greedy) or ``length_penalty`` say otherwise."""
        from gatedformer.tasks.translation import translate_lines

        self._require("translation", "translate")
        lines = [text] if isinstance(text, str) else list(text)
        out = translate_lines(self.model, self.config, self.data, lines, beam, length_penalty)
        return out[0] if isinstance(text, str) else out

    def fill_mask(self, text: str, top_k: int = 5) -> list[Any]:
        """The ``top_k`` likeliest pieces for the ``[MASK]`` in ``text`` as ``(piece, probability)`` pairs, likeliest
        first; for a text with several masks, such a list for each (a masked language model; see
        :func:`gatedformer.tasks.mlm.fill_mask`)."""
        from gatedformer.tasks.mlm import fill_mask

        self._require("mlm", "fill_mask")
        found = fill_mask(self.model, self.data, text, top_k, self.config.model.max_positions)
        return found[0] if len(found) == 1 else found

    @property
    def labels(self) -> tuple[str, ...] | None:
        """A classifier's class names, in the order of its outputs (``("negative", "positive")``; GLUE's as its files
        write them); ``None`` for a model that scores (STS-B). A :class:`ConfigError` for a model that does not
        classify."""
        return self.task.class_names(self.data)

    @property
    def reads_pairs(self) -> bool:
        """Whether :meth:`classify` takes pairs of sentences (a GLUE task such as MRPC) rather than sentences."""
        return self.task.reads_pairs(self.data)

    def classify(self, inputs: str | tuple[str, str] | Sequence[str | tuple[str, str]], probabilities: bool = False,
                 batch_size: int = 64) -> Any:
        """The class of one example, or of each of several (a list): a sentence (a string), or a pair of sentences
        (a tuple of two strings) for a GLUE task that reads two. Each is its class name (:attr:`labels`), or with
        ``probabilities`` a dictionary from every class name to its probability; a model that scores (STS-B) gives
        its score on the task's scale. The text is read as the task's data is (a sentence-classification set's
        tokenisation and case, a BERT's tokenizer)."""
        single = isinstance(inputs, str | tuple)
        items = [inputs] if single else list(inputs)  # type: ignore[list-item]
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        names = self.labels
        if names is None and probabilities:
            raise ConfigError(f"a {self.config.data.corpus} model scores, so it has no class probabilities; call "
                              "classify() without probabilities=True")
        out = self.task.classify(self.model, self.config, self.data, items, self.device, batch_size)
        if names is None:
            results: list[Any] = out.tolist()
        elif probabilities:
            results = [dict(zip(names, row, strict=True)) for row in out.tolist()]
        else:
            results = [names[i] for i in out.argmax(-1).tolist()]
        return results[0] if single else results

    def answer(self, context: str | Sequence[str], question: str | Sequence[str], batch_size: int = 32) -> Any:
        """The answer to ``question`` about ``context`` (a paragraph), by a question-answering model: a dictionary of
        the answer's text (``"answer"``, a span of the context), its characters in the context (``"start"``,
        ``"end"``: ``context[start:end]``) and its ``"score"``, the model's probability of that span; for a list of
        contexts and a list of questions, as many of each, a list of such. Bad text (empty, too long, not UTF-8) is
        one :class:`~gatedformer.errors.DataError` (see :func:`gatedformer.tasks.qa.check_question`)."""
        from gatedformer.tasks.qa import answer_questions

        self._require("qa", "answer")
        if isinstance(context, str) and isinstance(question, str):
            return answer_questions(self.model, self.config, self.data, [(context, question)], self.device)[0]
        lists = all(isinstance(x, Sequence) and not isinstance(x, str) for x in (context, question))
        if not lists or len(context) != len(question):
            raise ConfigError("answer() takes a context and a question, or two lists of as many contexts and "
                              "questions")
        return answer_questions(self.model, self.config, self.data, list(zip(context, question, strict=True)),
                                self.device, batch_size)

    # ---- sharing it ------------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the model to ``folder`` in the Hub convention: ``config.json`` (the run config, the task, the
        vocabulary sizes, the format's version), ``model.safetensors`` (with the checksum and config the run's
        weights record), the task's vocabulary or tokenizer files and a ``README.md`` model card. A folder that
        holds anything but an earlier export is refused, never overwritten; an earlier export is replaced whole (its
        own files go, anything else in the folder stays), so the folder never mixes two models. One export at a time
        writes a folder: a second one, while the first holds its lock, is refused."""
        folder = Path(folder)
        _check_export_target(folder)
        files = self.task.inference_files(self.data)  # before anything is written: a task may not export
        created = not folder.exists()
        make_folder(folder, "export folder")
        lock = FolderLock(folder / EXPORT_LOCK, "export", remove=True)
        if not lock.acquire():
            raise InUseError(f"{folder} is being written by {lock.holder()}; one export writes a folder at a time: "
                             "wait for that one to end, or choose another folder")
        try:
            self._write_export(folder, files)
        finally:
            lock.release()
            if created:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: an export that failed before writing leaves no folder
        return folder

    def _write_export(self, folder: Path, files: dict[str, str]) -> None:
        earlier = _check_export_target(folder, locked=True)  # again: the folder is this export's alone now
        if earlier is not None:
            _retire_export(folder, earlier, keep={*files, WEIGHTS_FILE, CARD_FILE})
        config = self.config.to_dict()
        for name, text in files.items():
            atomic_write_text(folder / name, text)
        # The vocabulary's checksums go into the weights' metadata, which the weights' own checksum covers.
        save_model_weights(self.model, folder / WEIGHTS_FILE, weights_metadata(config, files_checksums(folder, files)))
        record = {"format": EXPORT_FORMAT, "format_version": FORMAT_VERSION, "gatedformer": __version__,
                  "task": self.task.name, "backbone": self.config.model.backbone,
                  "vocab_sizes": _vocab_sizes(self.data),
                  "parameters": sum(p.numel() for p in self.model.parameters()),
                  "files": sorted(files), "config": config,
                  # where the run was trained is the trainer's business, not the model's
                  "results": json_safe({k: v for k, v in self.results.items() if k != "run_dir"})}
        atomic_write_text(folder / CARD_FILE, model_card(self, record))
        # Last: a folder with config.json is a whole export (an interrupted one is refused by from_pretrained).
        atomic_write_text(folder / CONFIG_FILE, json.dumps(record, indent=2, ensure_ascii=False) + "\n")

    def push_to_hub(self, repo_id: str, private: bool = False, token: str | None = None,
                    commit_message: str = "Upload gatedformer model") -> str:
        """Export the model (:meth:`save_pretrained`) into a temporary folder and upload it to the Hugging Face Hub
        repository ``repo_id`` (created where missing); returns the commit's address. Needs
        ``pip install 'gatedformer[hub]'`` and a token (``token``, ``HF_TOKEN`` or ``huggingface-cli login``)."""
        hub = _hub()
        if not _REPO_ID.match(repo_id) or "/" not in repo_id:
            raise ConfigError(f"{repo_id!r} is not a Hub repository id; write it as OWNER/NAME")
        api = hub.HfApi(token=token)
        with tempfile.TemporaryDirectory(prefix="gatedformer-export-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "model")
            try:
                api.create_repo(repo_id, private=private, exist_ok=True)
                info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=commit_message)
            except Exception as err:  # noqa: BLE001 - network, authentication, permission: one line for the user
                raise OutputError(f"could not upload to the Hub repository {repo_id} ({_first_line(err)}); check "
                                  "your token (HF_TOKEN or huggingface-cli login) and network") from None
        return str(getattr(info, "commit_url", info))


def _vocab_sizes(data: Any) -> dict[str, int]:
    if hasattr(data, "vocab"):
        return {"vocab": len(data.vocab)}
    if hasattr(data, "src") and hasattr(data, "tgt"):
        return {"src": len(data.src), "tgt": len(data.tgt)}
    if isinstance(data, tuple):
        data = data[-1]
    try:
        return {"vocab": len(data)}
    except TypeError:
        return {}


def _check_export_target(folder: Path, locked: bool = False) -> dict[str, Any] | None:
    """Refuse an export folder that holds anything but an earlier export; return that export's record (``None``:
    a new or empty folder). Unless ``locked`` (this process holds the folder's export lock), a folder another export
    may be writing passes: the check is made again under the lock."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        raise OutputError(f"{folder} is a file, not a folder; choose another export folder")
    record = _export_record(folder)
    if record is None and not locked and (folder / EXPORT_LOCK).exists():
        return None
    if record is None and any(entry.name != EXPORT_LOCK for entry in folder.iterdir()):
        raise OutputError(f"{folder} is not empty and not a gatedformer export; choose an empty or new folder (an "
                          "earlier export is replaced)")
    return record


def _retire_export(folder: Path, record: dict[str, Any], keep: set[str]) -> None:
    """Remove the earlier export in ``folder`` before a new one is written: its ``config.json`` first (until the new
    one lands last, the folder is no whole export, never the old config over new weights), then the files it lists
    that the new export does not write again (another task's vocabulary). Nothing it does not list is touched."""
    listed = record.get("files")
    names = [CONFIG_FILE, *(name for name in (listed if isinstance(listed, list) else [])
                            if isinstance(name, str) and Path(name).name == name and name not in keep)]
    for name in names:
        path = folder / name
        try:
            if path.is_symlink() or path.is_file():
                path.unlink()
        except OSError as err:
            raise OutputError(f"could not remove {path} of the earlier export ({_first_line(err)}); remove the "
                              "folder or choose another") from None


def _export_record(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(read_limited(folder / CONFIG_FILE, _CONFIG_BYTES))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == EXPORT_FORMAT else None


def model_card(model: Pretrained, record: dict[str, Any]) -> str:
    """The ``README.md`` of an exported model: Hub metadata, what the model is, its scores, how to load it."""
    cfg = model.config
    results = record["results"]
    scores = [(key, value) for key, value in results.items()
              if isinstance(value, int | float) and not isinstance(value, bool)]
    metric = results.get("metric") if isinstance(results.get("metric"), str) else None
    rows = "\n".join(f"| {_score_name(key, metric)} (`{key}`) | {_number(value)} |" for key, value in scores) \
        or "| (no results.json) | |"
    sizes = ", ".join(f"{key} {value:,}" for key, value in record["vocab_sizes"].items()) or "in its files"
    return f"""---
library_name: gatedformer
tags:
- gatedformer
- {model.task.name}
- {cfg.model.backbone}
---

# {cfg.model.backbone} {model.task.title} ({cfg.data.corpus})

A gatedformer model exported by `save_pretrained` (format {EXPORT_FORMAT} version {FORMAT_VERSION}).

| | |
|---|---|
| task | {model.task.title} (`{model.task.name}`) |
| backbone | `{cfg.model.backbone}`: {cfg.model.n_layers} layers, d_model {cfg.model.d_model} |
| gates | `{cfg.model.gates or "none (baseline)"}` |
| corpus | `{cfg.data.corpus}` |
| vocabulary | {sizes} |
| parameters | {record["parameters"]:,} ({record["parameters"] / 1e6:.2f}M) |

## Results (the run's `results.json`)

| score | value |
|---|---|
{rows}

## Use

```python
import gatedformer

model = gatedformer.from_pretrained("THIS_FOLDER_OR_REPO_ID")
{_usage(model)}
```

The whole run config is in `config.json`; the weights in `model.safetensors` carry a SHA-256 checksum that
`from_pretrained` checks.
"""


def classify_input(path: str | Path | None) -> Iterator[str]:
    """The lines ``gatedformer classify`` reads, from the file ``path`` (``None``: standard input), as they come
    (:func:`~gatedformer.io.input_lines`)."""
    return input_lines(path, "give UTF-8 text, one sentence a line (two with a tab between for a pair task)")


def classify_lines(model: Pretrained, lines: Iterable[str], batch_size: int = 64, probabilities: bool = False
                   ) -> Iterator[str]:
    """``gatedformer classify``: :meth:`Pretrained.classify` of lines of text as they come, ``batch_size`` at a time,
    one output line for each (an empty one for an empty line): the class name, or the score of a model that scores,
    and with ``probabilities`` a tab and the class's probability. A line of a task that reads pairs holds its two
    sentences with a tab between them. A model that does not classify fails here, before a line is read."""
    names, pairs = model.labels, model.reads_pairs
    if names is None and probabilities:
        raise ConfigError(f"a {model.config.data.corpus} model scores, so it has no class probabilities; leave out "
                          "--probabilities")

    def example(number: int, line: str) -> str | tuple[str, str]:
        if not pairs:
            return line
        first, tab, second = line.partition("\t")
        if not tab or "\t" in second:
            raise DataError(f"input line {number} holds {line.count(chr(9)) + 1} sentence(s), but a "
                            f"{model.config.data.corpus} model reads two a line; separate them with one tab")
        return first, second

    def formatted(result: Any) -> str:
        if names is None:
            return f"{result:.3f}"
        if not probabilities:
            return str(result)
        label = max(result, key=result.get)
        return f"{label}\t{result[label]:.4f}"

    def outputs() -> Iterator[str]:
        chunk: list[tuple[int, str]] = []
        for number, line in enumerate(itertools.chain(lines, [None]), start=1):
            if line is not None:
                chunk.append((number, line))
            if chunk and (line is None or len(chunk) >= batch_size):
                wanted = [(n, example(n, text)) for n, text in chunk if text.strip()]
                results = iter(model.classify([item for _, item in wanted], probabilities, batch_size)
                               if wanted else [])
                kept = {n for n, _ in wanted}
                yield from (formatted(next(results)) if n in kept else "" for n, _ in chunk)
                chunk = []

    return outputs()


def _score_name(key: str, metric: str | None) -> str:
    """A results.json field as a reader names it: ``valid_metric`` of a character model is its valid bpc."""
    if metric and key.endswith("_metric"):
        return f"{key.removesuffix('_metric').replace('_', ' ')} {metric}"
    return "parameters" if key == "params" else key.replace("_", " ")


def _number(value: float) -> str:
    # Counts with their thousands (2,748,940, never 2.74894e+06); scores to four decimals.
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4f}"


EXAMPLE_PROMPTS = ("The ", "the ", "a ", "A ")
"""The card's ``generate`` prompt: the first of these the model's vocabulary spells (ptb-char has no capitals, a
word-level vocabulary may not know "The"), else none."""

EXAMPLE_INPUTS: dict[str, str] = {
    "trec": "How tall is the Sears Building ?",
    "subj": "The film follows a young woman who moves to Paris.",
    "cr": "The battery lasts all day and the screen is sharp.",
    "mpqa": "strongly opposes the plan",
    "glue-cola": "The book was written by her.",
    "glue-mrpc": ("He said the deal was done.", "The deal was done, he said."),
    "glue-stsb": ("A man is playing a guitar.", "A man plays the guitar."),
    "glue-rte": ("A cat sat on the mat.", "An animal sat on the mat."),
    "glue-wnli": ("The trophy did not fit in the suitcase because it was too big.", "The trophy was too big."),
    "glue-qnli": ("Where is the Eiffel Tower?", "The Eiffel Tower stands in Paris."),
}
"""The card's ``classify`` example for each classification set, in its own kind of text (a question for TREC, a
pair for a pair task); sentiment sets (MR, SST, SST-2) read a review's sentence."""


def _example_prompt(vocab: Any) -> str | None:
    for prompt in EXAMPLE_PROMPTS:
        try:
            ids = vocab.encode(prompt)
        except (GatedformerError, KeyError, ValueError):
            continue
        if ids and (vocab.unk_id is None or vocab.unk_id not in ids):
            return prompt
    return None


def _usage(model: Pretrained) -> str:
    task, corpus = model.task.name, model.config.data.corpus
    if task == "lm":
        prompt = _example_prompt(model.data.vocab)
        if prompt is None:
            return "print(model.generate(max_tokens=200, seed=0))  # a prompt must use the vocabulary's characters"
        return f"print(model.generate({prompt!r}, max_tokens=200, seed=0))"
    if task == "translation":
        return 'print(model.translate("A man is riding a bike."))'
    if task == "mlm":
        return 'print(model.fill_mask("the cat sat on the [MASK] ."))'
    if task in ("sentclass", "glue"):
        example = EXAMPLE_INPUTS.get(corpus, "A gripping, funny film.")
        if model.labels is None:  # STS-B scores a pair
            return f"print(model.classify({example!r}))  # a similarity score"
        return f"print(model.classify({example!r}), model.labels)"
    if task == "qa":
        return 'print(model.answer("The Normans gave their name to Normandy.", "What is named after the Normans?"))'
    return "model.model  # the network, in eval mode"


def load(run_dir: str | Path, device: str = "auto", data_dir: str | Path | None = None) -> Pretrained:
    """The trained model of the run folder ``run_dir`` (its final weights, else its latest checkpoint's), in eval
    mode on ``device``, with its vocabulary or tokenizer (a language model's is read from its corpus:
    ``data_dir`` says where, as ``--data-dir`` does)."""
    run = load_trained(run_dir, data_dir, device)
    results = None
    results_file = Path(run_dir) / "results.json"
    if results_file.is_file():
        try:
            results = json.loads(read_limited(results_file, _CONFIG_BYTES))
        except (OSError, ValueError):
            results = None
    return Pretrained(run.config, run.task, run.model, run.data, results if isinstance(results, dict) else None,
                      Path(run_dir))


def export_run(run_dir: str | Path, out: str | Path, device: str = "cpu", data_dir: str | Path | None = None
               ) -> Path:
    """``gatedformer export``: :func:`load` the run, then ``save_pretrained`` it to ``out`` (a folder in the way
    is refused before the run is loaded)."""
    folder = output_path(out, "--out")
    _check_export_target(folder)
    return load(run_dir, device, data_dir).save_pretrained(folder)


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError("the Hugging Face Hub needs huggingface_hub: pip install 'gatedformer[hub]'") from None
    return huggingface_hub


def _hub_timeout(hub: Any) -> float:
    """Seconds to wait for each answer of the Hub: ``HF_HUB_ETAG_TIMEOUT`` as the environment says it now, else
    ``huggingface_hub``'s default. Without one, an endpoint that takes the connection and never answers would keep
    ``from_pretrained`` waiting for good."""
    text = os.environ.get("HF_HUB_ETAG_TIMEOUT", "").strip()
    try:
        seconds = float(text) if text else float(hub.constants.HF_HUB_ETAG_TIMEOUT)
    except ValueError:
        raise ConfigError(f"HF_HUB_ETAG_TIMEOUT={text[:40]!r} is not a number of seconds; set it to e.g. 10"
                          ) from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"HF_HUB_ETAG_TIMEOUT={text[:40]!r} must be a positive number of seconds; set it to e.g. 10")
    return seconds


def _exported_file(name: str) -> bool:
    """Whether a file of a Hub repository is one an export has (never a pickle, never code): only these are
    downloaded."""
    return "/" not in name and (name in (CONFIG_FILE, WEIGHTS_FILE, CARD_FILE) or name.endswith((".json", ".txt")))


def _timed_out(err: BaseException) -> bool:
    chain: BaseException | None = err
    while chain is not None:
        if isinstance(chain, TimeoutError) or "Timeout" in type(chain).__name__:
            return True
        chain = chain.__cause__ or chain.__context__
    return False


def _download(repo_id: str, revision: str | None, token: str | None) -> Path:
    hub = _hub()
    timeout = _hub_timeout(hub)
    endpoint = os.environ.get("HF_ENDPOINT") or None  # as it is now, not as it was when huggingface_hub was imported
    try:
        # Every request with the timeout: snapshot_download lists a repository without one.
        info = hub.HfApi(endpoint=endpoint, token=token).repo_info(repo_id, revision=revision, timeout=timeout)
        names = sorted(sibling.rfilename for sibling in info.siblings or [] if _exported_file(sibling.rfilename))
        paths = [hub.hf_hub_download(repo_id, name, revision=info.sha or revision, token=token, endpoint=endpoint,
                                     etag_timeout=timeout) for name in names]
    except Exception as err:  # noqa: BLE001 - not found, no network, no access: one line for the user
        if _timed_out(err):
            where = endpoint or hub.constants.ENDPOINT
            raise ConfigError(f"the Hugging Face Hub at {where} did not answer within {timeout:g} s while "
                              f"downloading {repo_id!r}; check the network and HF_ENDPOINT, or wait longer with "
                              "HF_HUB_ETAG_TIMEOUT=SECONDS") from None
        raise ConfigError(f"{repo_id!r} is neither a local folder nor a Hub repository that could be downloaded "
                          f"({_first_line(err)})") from None
    if CONFIG_FILE not in names:
        raise ConfigError(f"the Hub repository {repo_id!r} holds no {CONFIG_FILE}, so it is no gatedformer export; "
                          "export a model with `gatedformer export` or save_pretrained and upload that")
    return Path(paths[names.index(CONFIG_FILE)]).parent


def from_pretrained(name_or_path: str | Path, device: str = "auto", revision: str | None = None,
                    token: str | None = None) -> Pretrained:
    """The model ``save_pretrained`` wrote to a folder, or to a Hub repository (``OWNER/NAME``; downloaded with
    ``huggingface_hub``, only its config, weights, vocabulary and card), in eval mode on ``device``: the same
    weights, so the same outputs, as the model that was saved."""
    path = Path(name_or_path)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{path} is a file; from_pretrained takes the folder save_pretrained wrote")
        folder = path
    elif isinstance(name_or_path, str) and _REPO_ID.match(name_or_path) and "/" in name_or_path:
        folder = _download(name_or_path, revision, token)
    else:
        raise ConfigError(f"{name_or_path} is not a folder, nor a Hub repository id (OWNER/NAME); pass the folder "
                          "save_pretrained or `gatedformer export` wrote")
    return _read_export(folder, device)


def _read_export(folder: Path, device: str) -> Pretrained:
    target = resolve_device(device)
    config_file = folder / CONFIG_FILE
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLES)
        if pickles:
            raise CheckpointError(f"{folder} holds {', '.join(pickles[:3])} but no {WEIGHTS_FILE}: pickle files can "
                                  "run code, and gatedformer never loads them; export the model with save_pretrained")
    if not config_file.is_file():
        raise CheckpointError(f"{folder} is not a gatedformer export (no {CONFIG_FILE}); export a run with "
                              "`gatedformer export --run RUN --out FOLDER`")
    try:
        record = json.loads(read_limited(config_file, _CONFIG_BYTES))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{config_file} is unreadable or not JSON ({_first_line(err)}); export the model "
                              "again") from None
    if not isinstance(record, dict) or record.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{config_file} is not a gatedformer export's config (no \"format\": "
                              f"\"{EXPORT_FORMAT}\"); export the model with save_pretrained")
    if record.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{config_file} is of format version {str(record.get('format_version'))[:20]}, which "
                              f"this gatedformer does not read (it reads {FORMAT_VERSION}); upgrade gatedformer")
    if not isinstance(record.get("config"), dict):
        raise CheckpointError(f"{config_file} has no run config; export the model again")
    config = config_from_dict(record["config"], where=str(config_file), check=True)
    task = get_task(task_of(config))
    if record.get("task") != task.name:
        raise CheckpointError(f"{config_file} says task {str(record.get('task'))[:40]!r} but its config is a "
                              f"{task.name} run; export the model again")
    files = record.get("files")
    if not isinstance(files, list) or not all(isinstance(name, str) and Path(name).name == name for name in files):
        raise CheckpointError(f"{config_file} lists no valid vocabulary files; export the model again")
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} lacks {', '.join(missing)}, which its config lists; copy the whole export")
    if not weights.is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS_FILE}; copy the whole export")
    try:
        tensors, metadata = read_tensors(weights)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{weights} is truncated, corrupt or changed ({_first_line(err)}); export the model "
                              "again") from None
    # Before the vocabulary is read: a changed one would silently turn the model's ids into other text.
    check_files(folder, metadata.get(FILES_KEY), str(weights), "export the model again (or copy the whole export "
                "again)", listed=files)
    data = task.inference_data(config, folder, None)
    model = task.build_model(config, data)
    try:
        recorded = json.loads(metadata["config"]) if "config" in metadata else None
    except ValueError:
        recorded = None
    check_architecture(recorded, config.to_dict(), str(weights))
    load_model_weights(model, tensors, str(weights))
    model.to(target).eval()
    results = record.get("results")
    return Pretrained(config, task, model, data, results if isinstance(results, dict) else None, folder)
