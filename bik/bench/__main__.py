"""``python -m bik.bench ARGS`` runs ``python -m bik bench ARGS``."""

import sys

from ..__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
