"""gatedformer: gated sequence models — SDU, highway gate, gated MHDPA, EAU, GRC, GLU and SRU —
with the backbones, data and recipes to reproduce the papers that introduced them."""

import sys as _sys
import traceback as _traceback

_previous_excepthook = _sys.excepthook


def _interrupted_while_loading(kind, value, tb) -> None:  # noqa: ANN001
    """Ctrl-C while the package loads (PyTorch takes seconds to import, before the command line's own handling of
    an interrupt begins) is one line, not a traceback through the import machinery; Python then ends by SIGINT
    (exit status 130). Any other exception goes to the hook there was."""
    if issubclass(kind, KeyboardInterrupt) and any(frame.f_code.co_filename == __file__
                                                   for frame, _ in _traceback.walk_tb(tb)):
        _sys.stderr.write("gatedformer: interrupted while starting; nothing was written\n")
        return
    _previous_excepthook(kind, value, tb)


_sys.excepthook = _interrupted_while_loading  # until the imports below are done

from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe  # noqa: E402
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError  # noqa: E402
from gatedformer.fused import fuse  # noqa: E402
from gatedformer.gates import EAU, GLU, SDU, GatedMHDPA, GatedResidual, GLUFeedForward, HighwayGate  # noqa: E402
from gatedformer.models import (  # noqa: E402
    SRU,
    GatedConvLM,
    RTransformerLM,
    SRULanguageModel,
    TransformerLM,
    TransformerXLLM,
    build_model,
    parse_gate_spec,
    resolve_placement,
)
from gatedformer.models.seq2seq import Seq2SeqTransformer  # noqa: E402
from gatedformer.pretrained import Pretrained, from_pretrained, load  # noqa: E402
from gatedformer.version import __version__  # noqa: E402

if _sys.excepthook is _interrupted_while_loading:
    _sys.excepthook = _previous_excepthook

__all__ = [
    "EAU",
    "GLU",
    "SDU",
    "SRU",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GLUFeedForward",
    "GatedConvLM",
    "GatedMHDPA",
    "GatedResidual",
    "GatedformerError",
    "HighwayGate",
    "Pretrained",
    "RTransformerLM",
    "RunConfig",
    "SRULanguageModel",
    "Seq2SeqTransformer",
    "TransformerLM",
    "TransformerXLLM",
    "__version__",
    "apply_overrides",
    "build_config",
    "build_model",
    "from_pretrained",
    "fuse",
    "load",
    "load_recipe",
    "parse_gate_spec",
    "resolve_placement",
]
