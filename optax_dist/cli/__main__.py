"""``python -m optax_dist.cli``: the ``optax-dist`` command."""

import sys

from optax_dist.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
