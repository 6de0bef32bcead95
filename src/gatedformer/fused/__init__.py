"""Where speed plugs in: the fused implementations of the models' modules, bound onto a model by :func:`fuse`.

Each module here registers, with :func:`~gatedformer.fused.registry.implements`, the fast paths of one family of
modules (the fused functions themselves live in :mod:`gatedformer.ops` and the kernels under them); the models stay
the reference (see :mod:`gatedformer.fused.registry`).
"""

from gatedformer.fused import (
    convs2s,  # noqa: F401  (registers its implementations)
    embedding,  # noqa: F401  (registers its implementations)
    gcnn,  # noqa: F401  (registers its implementations)
    output,  # noqa: F401  (registers its implementations)
    rtransformer,  # noqa: F401  (registers its implementations)
    sublayer,  # noqa: F401  (registers its implementations)
    transformer_xl,  # noqa: F401  (registers its implementations)
)
from gatedformer.fused.registry import (
    ENV_VAR,
    Implementation,
    fuse,
    implementations,
    implements,
    is_fused,
    reference,
    unfuse,
)

__all__ = ["ENV_VAR", "Implementation", "fuse", "implementations", "implements", "is_fused", "reference", "unfuse"]
