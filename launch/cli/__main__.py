"""`python -m launch.cli ...` is `kiln ...`."""

import sys

from launch.cli.main import main

sys.exit(main())
