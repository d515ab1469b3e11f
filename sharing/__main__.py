"""`python -m sharing` runs the same CLI as the `sharing` console script."""

from sharing.cli import main

raise SystemExit(main())
