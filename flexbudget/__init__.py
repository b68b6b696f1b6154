"""`import flexbudget` is `import fxbudget`."""

import sys

import fxbudget

sys.modules[__name__] = fxbudget
