"""`python -m megascale_jax.flops`: model size, FLOPs and memory for a config (`megascale_jax.model.flops`)."""

import sys

from megascale_jax.model.flops import main

if __name__ == "__main__":
    sys.exit(main())
