"""The plain Python API: record, compare, compare_models, diff, determinism; everything else is glue."""

from .run import RecordSummary, compare, compare_models, read_golden, record

__all__ = ["RecordSummary", "compare", "compare_models", "read_golden", "record"]
