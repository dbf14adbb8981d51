"""``python -m bik.bench [options]``: bik's kernels timed against the non-invariant
baselines in one run; the same command line as ``python -m bik bench`` (``--help`` lists the
options)."""

import sys

from .__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
