"""Comparisons, reports, figures and counts of trained runs."""

# The modules of the tasks with comparisons of their own, imported for their registrations (analysis.text_tasks).
from gatedformer.analysis import glue, sentclass  # noqa: F401
