"""``python -m brewnet ...``: the same as the ``brewnet`` command."""
from .cli import main

raise SystemExit(main())
