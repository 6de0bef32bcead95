"""``python -m gatedformer.analysis.bench``: the same as ``gatedformer bench``."""

from gatedformer.analysis.bench.command import main

raise SystemExit(main())
