"""``python -m felix.deploy``: the deployment subcommands without the rest of ``felix``."""

from felix.deploy.cli import main

raise SystemExit(main())
