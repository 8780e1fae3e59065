"""``python -m activation_guard``: the same command line as the ``activation-guard`` script."""

from .cli import main

raise SystemExit(main())
