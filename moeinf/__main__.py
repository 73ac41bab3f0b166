"""`python -m moeinf` (and `torchrun ... -m moeinf`): the `moeinf` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
