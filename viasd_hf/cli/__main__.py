"""``python -m viasd_hf.cli``: the ``viasd`` command without its console script."""

import sys

from . import main

sys.exit(main())
