"""``python -m bench``: the training benchmark against peers (bench/run.py)."""

import sys

from bench.run import main

sys.exit(main())
