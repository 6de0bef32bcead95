"""gatedformer: gated sequence models — SDU, highway gate, gated MHDPA, EAU, GRC, GLU and SRU —
with the backbones, data and recipes to reproduce the papers that introduced them."""

__version__ = "0.1.0"

from gatedformer.backbones import TransformerLM, build_model, parse_gate_spec, resolve_placement  # noqa: E402
from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe  # noqa: E402
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError  # noqa: E402
from gatedformer.gates import EAU, GLU, SDU, GatedMHDPA, GatedResidual, GLUFeedForward, HighwayGate  # noqa: E402

__all__ = [
    "EAU",
    "GLU",
    "SDU",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GLUFeedForward",
    "GatedMHDPA",
    "GatedResidual",
    "GatedformerError",
    "HighwayGate",
    "RunConfig",
    "TransformerLM",
    "__version__",
    "apply_overrides",
    "build_config",
    "build_model",
    "load_recipe",
    "parse_gate_spec",
    "resolve_placement",
]
