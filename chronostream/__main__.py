"""``python -m chronostream`` runs the command line."""

import sys

from chronostream.cli import main

sys.exit(main())
