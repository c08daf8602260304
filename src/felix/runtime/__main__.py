"""``python -m felix.runtime``: the deployment subcommands without the rest of ``felix``."""
from felix.runtime.cli import main

raise SystemExit(main())
