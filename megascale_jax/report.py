"""`python -m megascale_jax.report`: the report of a run directory (`megascale_jax.observe.report`)."""

import sys

from megascale_jax.observe.report import main

if __name__ == "__main__":
    sys.exit(main())
