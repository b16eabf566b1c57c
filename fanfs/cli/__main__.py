"""`python -m fanfs.cli`: the `fanfs` command where its script is not installed."""

import sys

from fanfs.cli import main

sys.exit(main())
