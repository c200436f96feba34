"""`python -m lpf ...`: the `lpf` command (experiments start their cells this way, in a child process)."""

import sys

from lpf.cli import main

sys.argv[0] = "lpf"  # usage lines say `lpf`, as from the console script
main()
