"""`python -m distorefs` runs the `distore` command."""

import sys

from distorefs.cli import main

sys.exit(main())
