"""``python -m tessera.cli``: the ``tessera`` command."""

import sys

from tessera.cli import main

sys.exit(main())
