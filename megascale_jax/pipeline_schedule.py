"""`python -m megascale_jax.pipeline_schedule`: draw a pipeline schedule's tick table (`megascale_jax.parallel.pipeline_schedule`)."""

import sys

from megascale_jax.parallel.pipeline_schedule import main

if __name__ == "__main__":
    sys.exit(main())
