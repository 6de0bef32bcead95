"""The Python API and the Hub folder: ``gatedformer.load`` a run, ``save_pretrained``, ``from_pretrained`` (the same
weights, so the same logits, for every backbone and task), ``push_to_hub`` with the Hub mocked, ``gatedformer
export``, and damaged or hostile folders refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file, save_file
from test_cli import sets

import gatedformer
from gatedformer.cli import main
from gatedformer.config import backbone_names, build_config, load_recipe, task_of
from gatedformer.data import Vocab
from gatedformer.data.corpora import Corpus
from gatedformer.data.wordpiece import SPECIALS, WordPiece
from gatedformer.errors import CheckpointError, ConfigError, GatedformerError, OutputError
from gatedformer.pretrained import Pretrained
from gatedformer.tasks import get_task
from gatedformer.tasks.translation import Vocabularies

SMALL = ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ffn=32"]
NO_HEADS = ("gcnn", "sru", "convs2s")
"""Backbones without attention heads or a feed-forward, which refuse the fields they do not read."""
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def _pretrained(recipe: str, overrides: list[str], data: object) -> Pretrained:
    config = build_config(load_recipe(recipe), overrides)
    task = get_task(task_of(config))
    torch.manual_seed(0)
    model = task.build_model(config, data).eval()
    return Pretrained(config, task, model, data, {"valid_loss": 1.5, "test_loss": float("nan")})


def _char_corpus() -> Corpus:
    empty = torch.zeros(0, dtype=torch.long)
    return Corpus("text:x", "char", "bpc", Vocab(tuple("\nabcdefgh _"), "char"), empty, empty, empty)


@pytest.mark.parametrize("backbone", backbone_names())
def test_every_language_model_round_trips_bit_for_bit(backbone: str, tmp_path: Path) -> None:
    extra = {"transformer-xl": ["model.mem_len=4"], "gcnn": ["model.kernel_size=3"]}.get(backbone, [])
    gates = [] if backbone in ("gcnn", "sru") else ["model.gates=+σ SDU"]
    small = SMALL[:2] if backbone in NO_HEADS else SMALL
    saved = _pretrained("ptb-char-tiny", [f"model.backbone={backbone}", *small, *extra, *gates], _char_corpus())
    saved.save_pretrained(tmp_path / "export")
    loaded = gatedformer.from_pretrained(tmp_path / "export", device="cpu")
    _same_weights(saved.model, loaded.model)
    tokens = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        assert torch.equal(saved.model(tokens).logits, loaded.model(tokens).logits)
    assert loaded.data.vocab == saved.data.vocab and loaded.task.name == "lm" and not loaded.model.training
    assert loaded.generate("abc", max_tokens=12, seed=1) == saved.generate("abc", max_tokens=12, seed=1)
    assert loaded.results["valid_loss"] == 1.5 and loaded.results["test_loss"] is None  # NaN is no JSON


@pytest.mark.parametrize("backbone", backbone_names("translation"))
def test_every_translation_model_round_trips(backbone: str, tmp_path: Path) -> None:
    specials = ("<pad>", "<unk>", "<bos>", "<eos>")
    vocabularies = Vocabularies(Vocab(specials + tuple(WORDS)), Vocab(specials + ("der", "hund", "lief")))
    extra = (["model.conv_layers=", "model.decoder_conv_layers=", "model.kernel_size=3", "model.attn_dropout=0"]
             if backbone == "convs2s" else [])  # the recipe's attention dropout: ConvS2S has no attention heads
    small = SMALL[:2] if backbone in NO_HEADS else SMALL
    saved = _pretrained("multi30k-tiny", [f"model.backbone={backbone}", *small, *extra], vocabularies)
    saved.save_pretrained(tmp_path / "export")
    loaded = gatedformer.from_pretrained(str(tmp_path / "export"), device="cpu")
    _same_weights(saved.model, loaded.model)
    assert loaded.data == vocabularies
    assert loaded.translate("the dog ran", beam=2) == saved.translate("the dog ran", beam=2)
    with pytest.raises(ConfigError, match="generate\\(\\) needs a language-model model"):
        loaded.generate("the")


def _wordpiece(tmp_path: Path) -> WordPiece:
    (tmp_path / "vocab.txt").write_text("\n".join([*SPECIALS, *WORDS, "##s"]) + "\n", encoding="utf-8")
    return WordPiece.from_vocab_file(tmp_path / "vocab.txt")


def test_a_masked_language_model_round_trips_with_its_tokenizer(tmp_path: Path) -> None:
    tokenizer = _wordpiece(tmp_path)
    saved = _pretrained("bert-mlm-tiny", [*SMALL, "model.max_positions=32", "data.seq_len=16", "data.eval_seq_len=16",
                                              "model.gates=+EAU+GRC"], tokenizer)
    saved.save_pretrained(tmp_path / "export")
    assert {"tokenizer.json", "vocab.txt"} <= {p.name for p in (tmp_path / "export").iterdir()}
    loaded = gatedformer.from_pretrained(tmp_path / "export", device="cpu")
    _same_weights(saved.model, loaded.model)
    assert loaded.data.encode_texts(["the cats"]) == tokenizer.encode_texts(["the cats"])


def test_fill_mask_gives_the_masked_positions_pieces_as_the_full_logits_do(tmp_path: Path) -> None:
    tokenizer = _wordpiece(tmp_path)
    model = _pretrained("bert-mlm-tiny", [*SMALL, "model.max_positions=12", "data.seq_len=12", "data.eval_seq_len=12"],
                        tokenizer)
    found = model.fill_mask("The cat [MASK] on the mat", top_k=3)
    ids = [tokenizer.cls_id, *tokenizer.encode_texts(["the cat"])[0], tokenizer.mask_id,
           *tokenizer.encode_texts(["on the mat"])[0], tokenizer.sep_id]
    with torch.no_grad():
        logits = model.model(torch.tensor([ids])).logits[0, 3]  # every position's logits, read at the mask's
    logits[list(tokenizer.special_ids)] = float("-inf")
    chances, best = logits.softmax(-1).topk(3)
    assert [piece for piece, _ in found] == [tokenizer.piece(i) for i in best.tolist()]
    assert [p for _, p in found] == pytest.approx(chances.tolist(), rel=1e-5)
    assert all(piece not in SPECIALS for piece, _ in model.fill_mask("[MASK]", top_k=len(tokenizer)))
    two = model.fill_mask("[MASK] cat sat on a [MASK]", top_k=2)  # a list for each mask
    assert len(two) == 2 and all(len(candidates) == 2 for candidates in two)
    with pytest.raises(GatedformerError, match=r"the text has no \[MASK\]"):
        model.fill_mask("the cat sat")
    with pytest.raises(GatedformerError, match=r"15 pieces with \[CLS\] and \[SEP\], but the model reads at most 12"):
        model.fill_mask("the cat sat on a mat the dog ran on the [MASK] mat")
    with pytest.raises(ConfigError, match="top_k must be a whole number of at least 1"):
        model.fill_mask("[MASK]", top_k=0)
    lm = _pretrained("ptb-char-tiny", SMALL, _char_corpus())
    with pytest.raises(ConfigError, match=r"fill_mask\(\) needs a masked-language-model model"):
        lm.fill_mask("a [MASK]")


def test_a_run_loads_exports_and_reloads_in_a_fresh_process(text_corpus: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(run), "--quiet",
                 *sets(tiny_overrides(text_corpus, steps=4) + ["model.gates=+tanh SDU"])]) == 0
    model = gatedformer.load(run, device="cpu")
    assert isinstance(model, Pretrained) and not model.model.training and model.results["steps"] == 4
    exported = model.save_pretrained(tmp_path / "export")
    card = (exported / "README.md").read_text(encoding="utf-8")
    assert "+tanh SDU" in card and "test_metric" in card and "from_pretrained" in card
    record = json.loads((exported / "config.json").read_text())
    assert record["task"] == "lm" and record["vocab_sizes"]["vocab"] == len(model.data.vocab)
    assert "run_dir" not in record["results"]
    # the weights carry the run's checksum metadata
    assert (load_file(exported / "model.safetensors").keys() == load_file(run / "model.safetensors").keys())

    tokens = torch.randint(0, len(model.data.vocab), (1, 12))
    with torch.no_grad():
        expected = model(tokens).logits
    torch.save(tokens, tmp_path / "tokens.pt")
    script = ("import sys, torch, gatedformer\n"
              "m = gatedformer.from_pretrained(sys.argv[1], device='cpu')\n"
              "with torch.no_grad():\n"
              "    torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])\n")
    subprocess.run([sys.executable, "-c", script, str(exported), str(tmp_path / "tokens.pt"),
                    str(tmp_path / "logits.pt")], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)

    # the command line: export, refusing a folder in the way; generate with and without the cache
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "cli-export")]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "cli-export")]) == 0  # an export: rewritten
    capsys.readouterr()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "taken")]) == 2
    assert "not empty and not a gatedformer export" in capsys.readouterr().err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    texts = []
    for flag in ([], ["--no-cache"]):
        assert main(["generate", "--run", str(run), "--prompt", "the cat", "--tokens", "40", "--seed", "4",
                     "--context", "16", *flag]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("the cat")
    # a language model does not classify: one line that says so, from Python and from the command line
    with pytest.raises(ConfigError, match="language-model models do not classify text"):
        model.classify("the cat")
    (tmp_path / "lines.txt").write_text("the cat\n")
    assert main(["classify", "--run", str(run), "--input", str(tmp_path / "lines.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not classify text; classify with a sentence-classification or GLUE run" in err and "\n" not in err


def test_a_sentence_classifier_round_trips_with_its_words(tmp_path: Path) -> None:
    from gatedformer.data.sentclass import sentence_set
    from gatedformer.tasks.sentclass import Encoded, SentenceData

    empty = Encoded([], torch.zeros(0, dtype=torch.long))
    data = SentenceData(sentence_set("trec"), ["<pad>", "<unk>", *WORDS], empty, empty, empty, 16)
    saved = _pretrained("sentclass-sru-tiny", ["data.corpus=trec", "model.d_model=16", "sentclass.embedding_dim=16"],
                        data)
    saved.save_pretrained(tmp_path / "export")
    loaded = gatedformer.from_pretrained(tmp_path / "export", device="cpu")
    _same_weights(saved.model, loaded.model)
    assert loaded.data.words == data.words and loaded.data.set.name == "trec"
    (tmp_path / "export" / "vocab.json").write_text('{"words": ["the"], "embedding_dim": 16}')
    with pytest.raises(CheckpointError, match="vocab.json does not match the checksum"):
        gatedformer.from_pretrained(tmp_path / "export", device="cpu")


def test_a_new_export_replaces_an_earlier_one_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "export"
    _pretrained("ptb-char-tiny", SMALL, _char_corpus()).save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    tokenizer = _wordpiece(tmp_path)
    bert = _pretrained("bert-mlm-tiny", [*SMALL, "model.max_positions=32", "data.seq_len=16", "data.eval_seq_len=16"],
                       tokenizer)
    bert.save_pretrained(folder)
    # the language model's vocabulary went with it; what the user put there stayed
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "notes.txt", "tokenizer.json", "vocab.txt"]
    _same_weights(bert.model, gatedformer.from_pretrained(folder, device="cpu").model)

    # interrupted while writing the weights: no config.json of the old model stays over the new files
    def fail(*_: object) -> None:
        raise OutputError("disk full")

    monkeypatch.setattr("gatedformer.pretrained.save_model_weights", fail)
    with pytest.raises(OutputError, match="disk full"):
        _pretrained("bert-mlm-tiny", [*SMALL, "model.max_positions=32", "data.seq_len=16", "data.eval_seq_len=16",
                                      "model.gates=+EAU+GRC"], tokenizer).save_pretrained(folder)
    with pytest.raises(CheckpointError, match="no config.json"):
        gatedformer.from_pretrained(folder, device="cpu")
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.fixture
def export(tmp_path: Path) -> Path:
    return _pretrained("ptb-char-tiny", SMALL, _char_corpus()).save_pretrained(tmp_path / "export")


def _damage_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, str(path), metadata=metadata)  # the old checksum over new bytes


@pytest.mark.parametrize(("damage", "fragment"), [
    (lambda f: (f / "config.json").unlink(), "is not a gatedformer export (no config.json)"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json is unreadable or not JSON"),
    (lambda f: (f / "config.json").write_text('{"format": "other"}'), "is not a gatedformer export's config"),
    (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 40), "model.safetensors is truncated, corrupt"),
    (_damage_weights, "do not match the checksum"),
    (lambda f: (f / "vocab.json").unlink(), "lacks vocab.json"),
    (lambda f: (f / "vocab.json").write_text("[1, 2]"), "vocab.json does not match the checksum"),
])
def test_a_damaged_export_is_one_error(export: Path, damage, fragment: str) -> None:  # noqa: ANN001
    damage(export)
    with pytest.raises(GatedformerError, match=fragment.replace("(", "\\(").replace(")", "\\)")):
        gatedformer.from_pretrained(export, device="cpu")


def test_pickle_weights_are_never_loaded(export: Path, tmp_path: Path) -> None:
    (export / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    # A pickle that would create `marker` if it were ever unpickled.
    payload = (b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    (export / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(CheckpointError, match="pickle files can run code"):
        gatedformer.from_pretrained(export, device="cpu")
    assert not marker.exists()


def test_from_pretrained_of_neither_folder_nor_repo_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a folder, nor a Hub repository id"):
        gatedformer.from_pretrained(str(tmp_path / "no" / "such" / "folder"))


class _FakeHub:
    constants = SimpleNamespace(HF_HUB_ETAG_TIMEOUT=7, ENDPOINT="https://hub.example")

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def HfApi(self, token: str | None = None, endpoint: str | None = None) -> _FakeHub:  # noqa: N802 - the real name
        self.calls.append(("token", token))
        return self

    def repo_info(self, repo_id: str, revision: str | None, timeout: float) -> SimpleNamespace:
        self.calls.append(("info", repo_id, revision, timeout))
        names = [p.name for p in self.folder.iterdir()] + ["pytorch_model.bin", "modeling.py", "sub/extra.json"]
        return SimpleNamespace(sha="a" * 40, siblings=[SimpleNamespace(rfilename=name) for name in names])

    def hf_hub_download(self, repo_id: str, filename: str, revision: str, token: str | None, endpoint: str | None,
                        etag_timeout: float) -> str:
        self.calls.append(("download", repo_id, filename, revision, etag_timeout))
        return str(self.folder / filename)

    def create_repo(self, repo_id: str, private: bool, exist_ok: bool) -> None:
        self.calls.append(("create", repo_id, private, exist_ok))

    def upload_folder(self, folder_path: str, repo_id: str, commit_message: str) -> str:
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload", repo_id, files, json.loads(Path(folder_path, "config.json").read_text())["task"]))
        return f"https://huggingface.co/{repo_id}/commit/abc"


def test_push_to_hub_and_from_pretrained_of_a_repo_id_with_the_hub_mocked(
        export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    hub = _FakeHub(calls)
    hub.folder = export
    monkeypatch.setattr("gatedformer.pretrained._hub", lambda: hub)
    model = gatedformer.from_pretrained(export, device="cpu")
    assert model.push_to_hub("someone/tiny-lm", private=True, token="t") == \
        "https://huggingface.co/someone/tiny-lm/commit/abc"
    assert calls[:3] == [("token", "t"), ("create", "someone/tiny-lm", True, True),
                         ("upload", "someone/tiny-lm", ["README.md", "config.json", "model.safetensors", "vocab.json"],
                          "lm")]
    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)
    again = gatedformer.from_pretrained("someone/tiny-lm", device="cpu", revision="main")
    _same_weights(model.model, again.model)
    # the export's files alone (never a pickle, never code), of the commit the revision names, each request with
    # the Hub's timeout
    downloads = [call for call in calls if call[0] == "download"]
    assert ("info", "someone/tiny-lm", "main", 7.0) in calls
    assert sorted(call[2] for call in downloads) == ["README.md", "config.json", "model.safetensors", "vocab.json"]
    assert {(call[3], call[4]) for call in downloads} == {("a" * 40, 7.0)}
    with pytest.raises(ConfigError, match="not a Hub repository id"):
        model.push_to_hub("no repo id")


def test_a_failed_upload_is_one_error(export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _FakeHub([])

    def refuse(**kwargs: object) -> None:
        raise RuntimeError("401 Unauthorized\nmore")

    hub.upload_folder = refuse
    monkeypatch.setattr("gatedformer.pretrained._hub", lambda: hub)
    with pytest.raises(OutputError, match="could not upload to the Hub repository a/b \\(401 Unauthorized\\)"):
        gatedformer.from_pretrained(export, device="cpu").push_to_hub("a/b")
