"""`python -m megascale_jax.preflight`: diagnostics before training on a driverless cluster job (`megascale_jax.supervise.preflight`)."""

import sys

from megascale_jax.supervise.preflight import main

if __name__ == "__main__":
    sys.exit(main())
