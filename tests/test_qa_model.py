"""The document reader: exact padding, B.2's last-layer SRU against DrQA's concatenated bi-LSTMs, the fixed
embedding rows and the loss."""

from __future__ import annotations

import pytest
import torch

from gatedformer.models.reader import DocumentReader, StackedBiRNN
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import SRU

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    paragraph = torch.randint(1, 40, (3, 9))
    paragraph[1, 6:] = 0
    paragraph[2, 4:] = 0
    question = torch.randint(1, 40, (3, 5))
    question[0, 2:] = 0
    features = torch.rand(3, 9, 3) * (paragraph != 0).unsqueeze(-1)
    return paragraph, features, question


@pytest.mark.parametrize("rnn", ["sru", "lstm"])
def test_a_paragraph_scores_the_same_alone_and_in_a_padded_batch(rnn: str) -> None:
    torch.manual_seed(0)
    model = DocumentReader(40, 8, 6, 2, rnn).eval()
    paragraph, features, question = _batch()
    out = model(paragraph, features, question)
    assert isinstance(out, ModelOutput) and out.loss is None and out.logits.shape == (3, 2, 9)
    assert torch.isinf(out.logits[2, :, 4:]).all() and torch.isfinite(out.logits[2, :, :4]).all()
    alone = model(paragraph[2:, :4], features[2:, :4], question[2:])
    torch.testing.assert_close(out.logits[2, :, :4], alone.logits[0], rtol=1e-5, atol=1e-5)


def test_sru_reads_its_last_layer_and_lstm_concatenates_every_layer() -> None:
    sru, lstm = StackedBiRNN(5, 4, 3, "sru"), StackedBiRNN(5, 4, 3, "lstm")
    assert sru.output_size == 8 and lstm.output_size == 24
    assert all(isinstance(layer, SRU) and layer.bidirectional for layer in sru.layers)
    x, mask = torch.randn(2, 6, 5), torch.ones(2, 6, dtype=torch.bool)
    sru.eval()
    h = x.transpose(0, 1)
    for layer in sru.layers:
        h = layer(h)[0]
    torch.testing.assert_close(sru(x, mask), h.transpose(0, 1))  # the last layer's output, nothing else
    lstm.eval()
    out = lstm(x, mask)
    first = lstm.layers[0](x.transpose(0, 1))[0].transpose(0, 1)
    torch.testing.assert_close(out[..., :8], first)  # the first layer's output leads the concatenation


def test_only_the_tuned_rows_train_and_the_loss_is_start_plus_end() -> None:
    torch.manual_seed(0)
    model = DocumentReader(40, 8, 6, 2, "sru", fixed_from=12)
    paragraph, features, question = _batch()
    targets = torch.tensor([[0, 2], [1, 5], [3, 3]])
    out = model(paragraph, features, question, targets)
    logits = out.logits
    expected = (torch.nn.functional.cross_entropy(logits[:, 0], targets[:, 0])
                + torch.nn.functional.cross_entropy(logits[:, 1], targets[:, 1]))
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    grad = model.embedding.weight.grad
    assert grad[12:].abs().sum() == 0 and grad[1:12].abs().sum() > 0
