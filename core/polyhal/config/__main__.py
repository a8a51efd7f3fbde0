"""``python -m polyhal.config [--markdown]``: the environment variables polyhal reads."""

from polyhal.config import main

raise SystemExit(main())
