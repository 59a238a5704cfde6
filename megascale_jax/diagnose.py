"""`python -m megascale_jax.diagnose`: device and collective self-tests (`megascale_jax.supervise.diagnose`)."""

import sys

from megascale_jax.supervise.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
