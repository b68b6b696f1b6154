"""`python -m fxbudget.cli`: the `fxbudget` command."""

import sys

from . import main

sys.exit(main())
