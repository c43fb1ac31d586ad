"""``python -m circleops.cli ...``: the same as the ``circleops`` console script."""
import sys

from circleops.cli import main

sys.exit(main())
