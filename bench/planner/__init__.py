"""The planner (`megascale_jax.planner`) against measurements it was not fitted to."""
