"""Benchmark corpora: locating, verifying, fetching, tokenizing and batching them."""

from __future__ import annotations

from .batching import LMStream
from .corpora import Corpus, check_corpora, list_corpora, load_corpus
from .fetch import fetch_corpus
from .glue import GLUE_CORPORA
from .paths import cache_root, data_dir_candidates, fetch_target_dir, resolve_data_dir, user_data_dir
from .registry import CORPORA, CorpusSpec, FileSpec, get_spec
from .sentclass import SENTCLASS_CORPORA
from .squad import SQUAD_CORPORA
from .tokenize import TOKENIZER_VERSION
from .vocab import Vocab

# The classification sets are corpora too (listed, checked and fetched like the others); their own modules read them.
CORPORA.update(GLUE_CORPORA)
CORPORA.update(SENTCLASS_CORPORA)
CORPORA.update(SQUAD_CORPORA)

__all__ = [
    "CORPORA",
    "TOKENIZER_VERSION",
    "Corpus",
    "CorpusSpec",
    "FileSpec",
    "LMStream",
    "Vocab",
    "cache_root",
    "check_corpora",
    "data_dir_candidates",
    "fetch_corpus",
    "fetch_target_dir",
    "get_spec",
    "list_corpora",
    "load_corpus",
    "resolve_data_dir",
    "user_data_dir",
]
