"""``python -m gefen``: the ``gefen`` command where its console script is not on ``PATH``."""

import sys

from gefen.cli.main import main

sys.exit(main())
