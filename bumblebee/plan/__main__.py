"""``python -m bumblebee.plan``: the planner without the top-level CLI."""

import sys

from bumblebee.plan.cli import main

sys.exit(main())
