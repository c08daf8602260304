from felix.cli import main

raise SystemExit(main())
