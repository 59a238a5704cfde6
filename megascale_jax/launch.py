"""`python -m megascale_jax.launch`: a supervised job on this machine (`megascale_jax.supervise.launch`)."""

import sys

from megascale_jax.supervise.launch import main

if __name__ == "__main__":
    sys.exit(main())
