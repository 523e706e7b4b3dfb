"""`python -m lorad.daemon`: the same as the `lorad` console script."""

import sys

from lorad.daemon.main import main

sys.exit(main())
