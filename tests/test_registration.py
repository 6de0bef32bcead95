"""Tasks and their comparisons register themselves beside their classes and functions (backbones: see
test_backbone_registry.py): one table each, filled by the imports of their packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatedformer.analysis.glue import run_glue_comparison
from gatedformer.analysis.report import ComparisonReport
from gatedformer.analysis.sentclass import run_sentclass_comparison
from gatedformer.analysis.text_tasks import COMPARISONS, comparison_for, register_comparison
from gatedformer.cli import main
from gatedformer.config import load_recipe
from gatedformer.errors import ConfigError
from gatedformer.tasks import TASKS, get_task, register_task
from gatedformer.tasks.glue import GlueFinetuneTask
from gatedformer.tasks.lm import LanguageModelTask
from gatedformer.tasks.mlm import MaskedLMTask
from gatedformer.tasks.qa import QuestionAnsweringTask
from gatedformer.tasks.sentclass import SentenceClassificationTask
from gatedformer.tasks.translation import TranslationTask


def test_each_task_class_registers_itself_under_its_name() -> None:
    classes = {"lm": LanguageModelTask, "translation": TranslationTask, "mlm": MaskedLMTask,
               "glue": GlueFinetuneTask, "sentclass": SentenceClassificationTask, "qa": QuestionAnsweringTask}
    assert list(TASKS) == list(classes)  # the order get_task's error lists them in
    for name, cls in classes.items():
        assert type(TASKS[name]) is cls and cls.name == name and get_task(name) is TASKS[name]
    with pytest.raises(ConfigError, match=r"^unknown task 'nmt'; the tasks are lm, translation, mlm, glue, "
                                          r"sentclass, qa$"):
        get_task("nmt")


def test_a_new_task_is_one_decorated_class() -> None:
    from gatedformer.config import corpus_task

    @register_task("toy-lm", corpora=("toy-*",), sections=("translation",))
    class ToyTask(LanguageModelTask):
        title = "a toy run"

    try:
        assert ToyTask.name == "toy-lm" and isinstance(get_task("toy-lm"), ToyTask)
        assert corpus_task("toy-ptb") == "toy-lm" and corpus_task("ptb") == "lm"
        assert LanguageModelTask.name == "lm"  # the subclass's name is its own
    finally:
        from gatedformer.config import TASK_SECTIONS
        from gatedformer.data.registry import _TASK_CORPORA

        del TASKS["toy-lm"], TASK_SECTIONS["toy-lm"], _TASK_CORPORA["toy-lm"]
    with pytest.raises(ValueError, match="task 'lm' is registered twice"):
        register_task("lm")(ToyTask)
    assert type(TASKS["lm"]) is LanguageModelTask


def test_each_task_with_its_own_comparison_registers_it() -> None:
    assert dict(COMPARISONS) == {"mlm": run_glue_comparison, "sentclass": run_sentclass_comparison}
    assert comparison_for(load_recipe("bert-mlm-tiny")) is run_glue_comparison
    assert comparison_for(load_recipe("sentclass-sru-tiny")) is run_sentclass_comparison
    assert comparison_for(load_recipe("ptb-char-tiny")) is None
    assert comparison_for(load_recipe("multi30k-tiny")) is None
    with pytest.raises(ValueError, match="task 'mlm' has two comparisons"):
        register_comparison("mlm")(run_sentclass_comparison)
    assert COMPARISONS["mlm"] is run_glue_comparison


def test_compare_dispatches_through_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def toy_comparison(recipe, out_dir, seeds=1, overrides=None, data_dir=None, progress=True,  # noqa: ANN001
                       only=None) -> ComparisonReport:
        calls.append((recipe.name, Path(out_dir), seeds, only))
        return ComparisonReport(table="| toy |", report_path=Path(out_dir) / "report.md")

    monkeypatch.setitem(COMPARISONS, "lm", toy_comparison)
    assert main(["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "cmp"), "--seeds", "2",
                 "--variants", "baseline", "--quiet"]) == 0
    assert calls == [("ptb-char-tiny", tmp_path / "cmp", 2, ["baseline"])]
    assert "| toy |" in capsys.readouterr().out
    assert not (tmp_path / "cmp").exists()  # nothing of the generic comparison ran


def test_each_task_declares_the_corpora_it_reads() -> None:
    from gatedformer.config import corpus_task
    from gatedformer.data.registry import claim_corpora

    for corpus, task in (("multi30k", "translation"), ("WMT14 ", "translation"), ("glue-sst2", "glue"),
                         ("glue-unknown", "glue"), ("mr", "sentclass"), ("sst", "sentclass"), ("ptb", "lm"),
                         ("wikitext2", "lm"), ("text:/data/glue-notes.txt", "lm"), ("text:mr", "lm"),
                         ("squad", "qa"), ("squad-json:/data/My SQuAD", "qa")):
        assert corpus_task(corpus) == task, corpus
    with pytest.raises(ValueError, match=r"corpora \['mr'\] are claimed by task 'sentclass' and by 'toy'"):
        claim_corpora("toy", ("mr",))
    assert corpus_task("mr") == "sentclass"
    from gatedformer.data.registry import text_tasks

    assert text_tasks() == ("mlm",)  # the one task that claims no corpus: data.task names it on a text corpus


def test_the_tables_are_full_whichever_module_is_imported_first() -> None:
    import subprocess
    import sys

    code = ("from gatedformer.config import corpus_task, backbone_names; "
            "from gatedformer.analysis.text_tasks import COMPARISONS; "
            "print(corpus_task('multi30k'), backbone_names('glue'), sorted(COMPARISONS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["translation", "('bert',)", "['mlm',", "'sentclass']"]


def test_each_task_declares_the_config_sections_it_reads() -> None:
    from gatedformer.config import TASK_SECTIONS, register_task_sections

    assert TASK_SECTIONS == {"lm": (), "translation": ("translation",), "mlm": ("tokenizer", "mlm", "finetune"),
                             "glue": ("tokenizer", "finetune"), "sentclass": ("sentclass",),
                             "qa": ("qa",)}
    with pytest.raises(ValueError, match=r"task 'toy' declares sections \['model', 'nmt'\], which are not task "
                                         "sections of RunConfig"):
        register_task_sections("toy", ("translation", "nmt", "model"))
    assert "toy" not in TASK_SECTIONS
