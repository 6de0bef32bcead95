"""Question answering under data parallelism: each rank's share of a batch, weighted, gives the whole batch's loss
and gradients (the epoch's last, shorter batch too); two gloo processes train as one and resume bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import sets
from test_distributed import TIMING, torchrun, train_losses
from test_qa import _document

from gatedformer.config import build_config, load_recipe
from gatedformer.tasks import task_for
from gatedformer.train.loop import train

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Inside each torchrun worker: the equal run (no dropout) by the command line, then the run with dropout whole and
# stopped after 7 of 12 steps (the test resumes it with torchrun -m gatedformer train --resume).
WORKER = """
import json, sys
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.train.loop import train

spec = json.loads(sys.argv[1])
assert main(["train", "--recipe", "squad-sru-tiny", "--out", spec["equal"], "--quiet", *spec["equal_args"]]) == 0
config = build_config(load_recipe(spec["recipe"]), spec["dropout_overrides"])
train(config, spec["whole"], progress=False)
assert train(config, spec["split"], progress=False, stop_after=7) is None
"""


@pytest.fixture
def squad_dir(tmp_path: Path) -> Path:
    """23 training questions: batches of 2 end each epoch with one, which leaves the second rank without any."""
    train_doc = _document(6, 0)
    del train_doc["data"][5]["paragraphs"][1]["qas"][1]
    folder = tmp_path / "squad"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps(train_doc), encoding="utf-8")
    (folder / "dev.json").write_text(json.dumps(_document(1, 3)), encoding="utf-8")
    return folder


def _overrides(squad_dir: Path, *extra: str) -> list[str]:
    return [f"data.corpus=squad-json:{squad_dir}", "data.batch_size=2", "train.steps=12", "train.eval_every=6",
            "train.log_every=1", "train.device=cpu", *extra]


@pytest.mark.parametrize("rnn", ["sru", "lstm"])
def test_the_ranks_shares_weigh_up_to_the_whole_batch(squad_dir: Path, rnn: str) -> None:
    config = build_config(load_recipe("squad-sru-tiny"), _overrides(squad_dir, f"model.rnn={rnn}",
                                                                   "model.dropout=0", "model.emb_dropout=0"))
    task = task_for(config)
    whole = task.load_data(config, None)
    shards = [task.load_data(config, None, shard=(rank, 2)) for rank in range(2)]
    torch.manual_seed(0)
    model = task.build_model(config, whole)
    device = torch.device("cpu")

    def loss_and_grads(data, step):  # noqa: ANN001, ANN202
        batch = next(task.train_batches(data, config, step, None))
        model.zero_grad()
        loss, _ = task.loss(model, batch, None, config, device)
        loss.backward()
        return batch, loss.detach(), [p.grad.clone() for p in model.parameters()]

    sizes = [len(b) for b in task._order(whole, config, 0)]
    assert sorted(sizes) == [1] + [2] * 11
    for step in (sizes.index(2), sizes.index(1)):  # a full batch, and the one of a single question
        batch, loss, grads = loss_and_grads(whole, step)
        parts = [loss_and_grads(shard, step) for shard in shards]
        assert all(part[0].tokens == batch.tokens for part in parts)  # the whole batch's tokens, on every rank
        assert loss.item() == pytest.approx(((parts[0][1] + parts[1][1]) / 2).item(), rel=1e-5)
        for i, grad in enumerate(grads):
            assert torch.allclose(grad, (parts[0][2][i] + parts[1][2][i]) / 2, atol=1e-6, rtol=1e-4)
    assert parts[1][0].inputs[4].tolist() == [0.0]  # the empty share: one question at weight 0


@pytest.mark.slow
def test_two_processes_train_the_reader_like_one_and_resume_exactly(squad_dir: Path, tmp_path: Path) -> None:
    equal = _overrides(squad_dir, "model.dropout=0", "model.emb_dropout=0")
    dropout = _overrides(squad_dir, "model.rnn=lstm")
    spec = {"recipe": "squad-sru-tiny", "equal": str(tmp_path / "ddp"), "equal_args": sets(equal),
            "dropout_overrides": dropout, "whole": str(tmp_path / "whole"), "split": str(tmp_path / "split")}
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    torchrun(str(script), json.dumps(spec))

    single = train(build_config(load_recipe("squad-sru-tiny"), equal), tmp_path / "single", progress=False)
    assert train_losses(tmp_path / "ddp") == pytest.approx(train_losses(tmp_path / "single"), rel=1e-4, abs=1e-5)
    assert len(train_losses(tmp_path / "ddp")) == 12
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert ddp["f1"] == pytest.approx(single.valid_metric, abs=1e-6) and ddp["steps"] == 12
    assert (tmp_path / "ddp" / "predictions.json").is_file()

    torchrun("-m", "gatedformer", "train", "--recipe", "squad-sru-tiny", "--out", spec["split"], "--resume",
             "--quiet", *sets(dropout))
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    split = json.loads((tmp_path / "split" / "results.json").read_text())
    assert {k: v for k, v in whole.items() if k not in TIMING} == {k: v for k, v in split.items() if k not in TIMING}
    assert (tmp_path / "split" / "predictions.json").read_text() == (tmp_path / "whole" / "predictions.json"
                                                                     ).read_text()
