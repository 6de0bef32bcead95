"""``python -m gatedformer`` (also what ``torchrun -m gatedformer`` runs)."""

from gatedformer.cli import main

raise SystemExit(main())
