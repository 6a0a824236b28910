"""``python -m shardwise.checkpoint``: see ``_cli.py``."""

from ._cli import main

raise SystemExit(main())
