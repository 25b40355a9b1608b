"""`python -m mixprec ...` runs the `mixprec` command (see mixprec.cli)."""

import sys

from .cli.main import main

sys.exit(main())
