"""pytest glue over the plain API: options, the per-test check, the session and its reports.

This package is the ``pytest11`` entry point: pytest reads the hooks and fixtures below from it.
"""

from .hooks import (
    SESSION_KEY,
    activation_guard,
    ag_deterministic,
    ag_device,
    ag_process_group,
    pytest_addoption,
    pytest_collection_finish,
    pytest_configure,
    pytest_deselected,
    pytest_generate_tests,
    pytest_load_initial_conftests,
    pytest_report_header,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
    pytest_unconfigure,
)

__all__ = [
    "SESSION_KEY",
    "activation_guard",
    "ag_deterministic",
    "ag_device",
    "ag_process_group",
    "pytest_addoption",
    "pytest_collection_finish",
    "pytest_configure",
    "pytest_deselected",
    "pytest_generate_tests",
    "pytest_load_initial_conftests",
    "pytest_report_header",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_testnodedown",
    "pytest_unconfigure",
]
