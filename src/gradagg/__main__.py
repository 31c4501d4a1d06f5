"""``python -m gradagg``: the same command line as ``gradagg``."""

import sys

from gradagg.cli import main

sys.exit(main())
