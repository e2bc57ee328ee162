"""``python -m jaxsoft``: the command line (see ``python -m jaxsoft --help``; jaxsoft/_cli.py)."""

import sys

from jaxsoft._cli import main

if __name__ == "__main__":
  sys.exit(main())
