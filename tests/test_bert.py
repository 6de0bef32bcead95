"""BERT with gates: the layout against Hugging Face's BertModel (weights loaded into ours give the same outputs; the
same parameter count), masked-LM masking, the WordPiece tokenizer, and masked-LM pretraining end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gatedformer.config import build_config, load_recipe
from gatedformer.data.wordpiece import SPECIALS, WordPiece, encode_corpus
from gatedformer.errors import ConfigError, DataError
from gatedformer.gates import EAU, GatedResidual
from gatedformer.models.bert import BertEncoder, BertForMaskedLM, hf_to_ours
from gatedformer.tasks.base import rng
from gatedformer.tasks.mlm import IGNORE, mask_tokens, resolve_tokenizer, windows
from gatedformer.train.loop import train

transformers = pytest.importorskip("transformers")

SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ffn": 64, "max_positions": 40}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _hf_config():
    return transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=40)


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (3, 12), generator=generator)
    types = torch.randint(0, 2, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return tokens, types, mask


def test_hugging_face_weights_give_the_same_outputs() -> None:
    torch.manual_seed(0)
    hf = transformers.BertModel(_hf_config()).eval()
    ours = BertEncoder(50, **SMALL).eval()
    state = {k.removeprefix("bert."): v for k, v in hf_to_ours(hf.state_dict(), 2).items()}
    ours.load_state_dict(state, strict=True)  # every tensor of ours, no other
    tokens, types, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask)
        states = ours(tokens, types, mask)
        pooled = ours.pool(states[:, 0])
    real = mask.bool()
    torch.testing.assert_close(states[real], theirs.last_hidden_state[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pooled, theirs.pooler_output, atol=2e-5, rtol=1e-4)


def test_hugging_face_masked_lm_weights_give_the_same_logits() -> None:
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(_hf_config()).eval()
    ours = BertForMaskedLM(50, **SMALL).eval()
    missing, unexpected = ours.load_state_dict(hf_to_ours(hf.state_dict(), 2), strict=False)
    assert missing == ["head.decoder.weight"] and not unexpected  # the decoder's weight is the tied embedding
    tokens, types, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask).logits
        logits = ours(tokens, types, mask).logits
        positions = torch.tensor([[1, 4], [0, 7], [2, 3]])
        rows = ours(tokens, types, mask, positions=positions).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], theirs[real], atol=2e-5, rtol=1e-4)
    # Asking the last layer for a few rows computes exactly those rows.
    torch.testing.assert_close(rows, logits.gather(1, positions[..., None].expand(-1, -1, 50)), atol=1e-5, rtol=1e-5)


def test_bert_base_counts_what_hugging_face_counts_and_gates_add_their_own() -> None:
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.BertModel(transformers.BertConfig()).parameters())
        ours = sum(p.numel() for p in BertEncoder(30522).parameters())
        gated = BertEncoder(30522, gates="+EAU+GRC")
    assert ours == theirs == 109_482_240
    d, k = 768, 384
    eau, grc = d * k + k + k * d + d + d * d + d, d * d + d
    assert sum(p.numel() for p in gated.parameters()) == ours + 12 * (eau + 2 * grc)
    for layer in gated.layers:
        assert isinstance(layer.attn.eau, EAU) and layer.ffn.eau is None
        assert isinstance(layer.attn.grc, GatedResidual) and isinstance(layer.ffn.grc, GatedResidual)


def test_gated_encoder_last_layer_rows_match_the_whole_layer() -> None:
    torch.manual_seed(0)
    model = BertEncoder(50, gates="+EAU+GRC+σ SDU\\FFN", **SMALL).eval()
    tokens, types, mask = _batch()
    with torch.no_grad():
        whole = model(tokens, types, mask)
        rows = model(tokens, types, mask, select=torch.tensor([[0, 3], [5, 1], [4, 0]]))
    torch.testing.assert_close(rows[1, 0], whole[1, 5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[2, 1], whole[2, 0], atol=1e-5, rtol=1e-5)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=3), pad=st.integers(0, 4),
       gates=st.sampled_from(["", "+EAU", "+GRC", "+EAU+GRC"]))
def test_padding_leaves_every_sequence_as_it_is_alone(lengths: list[int], pad: int, gates: str) -> None:
    torch.manual_seed(0)
    model = BertEncoder(50, gates=gates, **SMALL).eval()
    width = max(lengths) + pad
    generator = torch.Generator().manual_seed(sum(lengths) * 31 + pad)
    tokens = torch.randint(1, 50, (len(lengths), width), generator=generator)
    types = torch.randint(0, 2, (len(lengths), width), generator=generator)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        batch = model(tokens, types, mask)
        for row, n in enumerate(lengths):
            alone = model(tokens[row: row + 1, :n], types[row: row + 1, :n])
            torch.testing.assert_close(batch[row, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_masking_chooses_fifteen_percent_and_replaces_80_10_10() -> None:
    vocab, mask_id, specials = 1000, 4, (0, 1, 2, 3, 4)
    stream = np.random.default_rng(0).integers(5, vocab, 200_000).astype(np.int32)
    batch = windows(stream, 64, 2, 3, 0, keep_last=False)[:400]
    inputs, positions, targets = mask_tokens(batch, rng(0, 1), 0.15, vocab, mask_id, specials)
    assert positions.shape == (400, 9) and (targets != IGNORE).all()  # round(0.15 * 62) = 9 of each row's 62
    assert (positions > 0).all() and (positions < 63).all()  # never [CLS] or [SEP]
    assert torch.equal(targets, batch.gather(1, positions))
    chosen = inputs.gather(1, positions)
    masked = (chosen == mask_id).float().mean().item()
    kept = (chosen == targets).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1 - 0.1 / vocab) < 0.015
    untouched = torch.ones_like(batch, dtype=torch.bool).scatter(1, positions, False)
    assert torch.equal(inputs[untouched], batch[untouched])
    again = mask_tokens(batch, rng(0, 1), 0.15, vocab, mask_id, specials)
    assert all(torch.equal(a, b) for a, b in zip(again, (inputs, positions, targets), strict=True))


def test_masking_pads_rows_of_shorter_sequences() -> None:
    batch = torch.tensor([[2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3], [2, 7, 8, 3, 0, 0, 0, 0, 0, 0, 0, 0]])
    _, positions, targets = mask_tokens(batch, rng(5), 0.3, 20, 4, (0, 1, 2, 3, 4))
    assert positions.shape == (2, 3)  # round(0.3 * 10) = 3, and max(1, round(0.3 * 2)) = 1
    assert (targets[1, 1:] == IGNORE).all() and targets[1, 0] in (7, 8)


def test_tokenizer_learned_saved_and_read_back(tmp_path: Path, text_corpus: str) -> None:
    tokenizer, ids = encode_corpus(text_corpus, None, None, 60)
    assert len(tokenizer) <= 60 and [tokenizer.tokenizer.id_to_token(i) for i in range(5)] == list(SPECIALS)
    assert set(ids) == {"train", "valid", "test"} and all(len(a) for a in ids.values())
    again = WordPiece.from_json(tokenizer.to_json())
    (tmp_path / "vocab.txt").write_text(tokenizer.vocab_txt(), encoding="utf-8")
    from_vocab = WordPiece.from_vocab_file(tmp_path / "vocab.txt")
    text = "The Cat sat on a mat."
    assert again.encode_texts([text]) == from_vocab.encode_texts([text]) == tokenizer.encode_texts([text])
    pair_ids, pair_types = tokenizer.encode_pairs(["the cat sat"], ["on the mat"], 64)
    assert pair_ids[0][0] == tokenizer.cls_id and pair_ids[0].count(tokenizer.sep_id) == 2
    assert pair_types[0][-1] == 1 and pair_types[0][0] == 0
    short, _ = tokenizer.encode_pairs(["the cat sat on a mat " * 10], ["the dog"], 12)
    assert len(short[0]) == 12


def _mlm_overrides(corpus: str, steps: int = 6) -> list[str]:
    return [f"data.corpus={corpus}", "data.seq_len=24", "data.batch_size=4", "data.eval_batch_size=8",
            "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.max_positions=32",
            "tokenizer.vocab_size=80", f"train.steps={steps}", "train.eval_every=3", "train.log_every=1",
            "train.eval_windows=4", "train.threads=1", "finetune.seq_len=32"]


def test_masked_lm_trains_scores_and_keeps_its_tokenizer(tmp_path: Path, text_corpus: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = build_config(load_recipe("bert-mlm-tiny"), _mlm_overrides(text_corpus) + ["model.gates=+EAU+GRC"])
    result = train(config, tmp_path / "run", progress=False)
    assert result is not None and result.metric == "ppl" and np.isfinite(result.valid_loss)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert 0.0 <= saved["valid_accuracy"] <= 1.0 and 0.0 <= saved["test_accuracy"] <= 1.0
    assert abs(saved["test_metric"] - np.exp(saved["test_loss"])) < 1e-6 * saved["test_metric"]
    assert (tmp_path / "run" / "vocab.txt").read_text().split("\n")[:5] == list(SPECIALS)
    from gatedformer.runs import evaluate_run

    scored = evaluate_run(tmp_path / "run", "valid")
    assert abs(scored["loss"] - result.valid_loss) < 1e-5

    # the trained model fills a mask from the command line: the likeliest pieces first, no special token
    from gatedformer.cli import main

    assert main(["fill-mask", "--run", str(tmp_path / "run"), "--text", "The [MASK] sat on the [MASK] .",
                 "--top-k", "3", "--device", "cpu"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["1", "1", "1", "2", "2", "2"] and not {r[1] for r in rows} & set(SPECIALS)
    chances = [float(r[2]) for r in rows]
    assert chances[:3] == sorted(chances[:3], reverse=True) and 0.0 < sum(chances[:3]) <= 1.0
    assert main(["fill-mask", "--run", str(tmp_path / "run"), "--text", "no mask here"]) == 2
    assert "the text has no [MASK]" in capsys.readouterr().err


def test_starts_from_a_hugging_face_checkpoint_with_fresh_gates(tmp_path: Path, text_corpus: str) -> None:
    torch.manual_seed(0)
    tokenizer, _ = encode_corpus(text_corpus, None, None, 80)
    folder = tmp_path / "hf"
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32))
    hf.save_pretrained(folder)
    (folder / "vocab.txt").write_text(tokenizer.vocab_txt(), encoding="utf-8")
    overrides = _mlm_overrides(text_corpus, steps=1) + [f"model.init_from_hf={folder}", "model.gates=+EAU",
                                                        "optim.lr=1e-12", "model.dropout=0", "model.attn_dropout=0"]
    train(build_config(load_recipe("bert-mlm-tiny"), overrides), tmp_path / "run", progress=False)
    from safetensors.torch import load_file

    ours = load_file(str(tmp_path / "run" / "model.safetensors"))
    hf_state = hf.state_dict()
    torch.testing.assert_close(ours["bert.embeddings.tokens.weight"],
                               hf_state["bert.embeddings.word_embeddings.weight"], atol=1e-8, rtol=0)
    torch.testing.assert_close(ours["bert.layers.1.ffn.body.outer.weight"],
                               hf_state["bert.encoder.layer.1.output.dense.weight"], atol=1e-8, rtol=0)
    assert "bert.layers.0.attn.eau.adjuster.weight" in ours
    with pytest.raises(ConfigError, match="another model size"):
        bad = overrides + ["model.d_ffn=48"]
        train(build_config(load_recipe("bert-mlm-tiny"), bad), tmp_path / "bad", progress=False)


def test_bert_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="post-LN"):
        build_config(load_recipe("bert-mlm-tiny"), ["model.norm=pre"])
    with pytest.raises(ConfigError, match="data.task"):
        build_config(load_recipe("bert-mlm-tiny"), ["data.corpus=glue-rte", "data.task=mlm"])
    with pytest.raises(ConfigError, match="max_positions"):
        build_config(load_recipe("bert-mlm-tiny"), ["data.seq_len=600"])
    missing = build_config(load_recipe("bert-mlm-tiny"), ["model.init_from_hf=/nonexistent/bert"])
    with pytest.raises(DataError, match=r"model.init_from_hf=/nonexistent/bert: no such folder"):
        resolve_tokenizer(missing)


def test_any_run_can_start_from_another_runs_weights(tmp_path: Path, text_corpus: str) -> None:
    from conftest import tiny_overrides
    from safetensors.torch import load_file

    from gatedformer.errors import CheckpointError

    first = build_config(load_recipe("ptb-char-tiny"), tiny_overrides(text_corpus, steps=4))
    train(first, tmp_path / "first", progress=False)
    after = tiny_overrides(text_corpus, steps=1) + [f"train.init_from={tmp_path / 'first'}", "optim.lr=1e-12",
                                                    "train.threads=1"]
    train(build_config(load_recipe("ptb-char-tiny"), after), tmp_path / "second", progress=False)
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("first", "second"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    wider = build_config(load_recipe("ptb-char-tiny"), after + ["model.d_ffn=48"])
    with pytest.raises(CheckpointError, match=r"another architecture: model.d_ffn \(32 saved, 48 now\)"):
        train(wider, tmp_path / "third", progress=False)


def test_bench_times_both_steps_against_hugging_face() -> None:
    from gatedformer.analysis.bench import BenchOptions, BenchSize, format_report, run_bench

    size = BenchSize(d_model=16, n_layers=2, n_heads=2, d_ffn=32, seq_len=12, batch=2)
    report = run_bench(size, BenchOptions(repeats=2, warmup=1, threads=1), sections=["bert"])
    rows = report.section("bert")
    assert [(r["step"], r["status"]) for r in rows] == [("masked LM", "ok")] * 2 + [("fine-tuning", "ok")] * 2
    assert rows[0]["params"] == rows[1]["params"] and rows[2]["params"] == rows[3]["params"]
    assert rows[0]["ours_train_speedup"] == 1.0 and rows[1]["ours_train_speedup"] > 0
    assert "BERT against Hugging Face transformers" in format_report(report)


def test_params_counts_the_encoder_as_hugging_face_does(capsys: pytest.CaptureFixture[str]) -> None:
    from gatedformer.cli import main

    assert main(["params", "--recipe", "bert-mlm-paper", "--vocab-size", "30522"]) == 0
    lines = capsys.readouterr().out.splitlines()
    baseline = next(line for line in lines if line.startswith("BERT "))
    assert "109,482,240" in baseline and "MLM head 622,650 apart" in baseline and "pooler 590,592" in baseline
    assert any(line.startswith("+EAU+GRC") and "gate: EAU" in line and "gate: GRC" in line for line in lines)
