"""``python -m raytrain_guard.cli``."""

import sys

from raytrain_guard.cli.parser import main

sys.exit(main())
