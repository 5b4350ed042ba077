"""``python -m tools.emucluster``: see tools/emucluster/cli.py."""

import sys

from tools.emucluster.cli import main

sys.exit(main())
