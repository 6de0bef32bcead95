"""gatedformer: gated sequence models — SDU, highway gate, gated MHDPA, EAU, GRC, GLU and SRU —
with the backbones, data and recipes to reproduce the papers that introduced them."""

from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe  # noqa: E402
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError  # noqa: E402
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
from gatedformer.version import __version__

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
    "load",
    "load_recipe",
    "parse_gate_spec",
    "resolve_placement",
]
