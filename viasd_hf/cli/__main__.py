"""``python -m viasd_hf.cli``: the ``viasd`` command without its console script."""

import sys

from viasd_hf.cli import main

sys.exit(main())
