"""``python -m rollmesh.cli``: the same as the ``rollmesh`` command (``up`` spawns itself this way)."""

import sys

from rollmesh.cli import main

sys.exit(main())
