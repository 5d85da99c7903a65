"""`python -m trainwatch`: the same as the `trainwatch` command."""

import sys

from trainwatch.cli import main

sys.exit(main())
