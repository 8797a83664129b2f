"""Parameters: the unit cache, its prefetch schedule, forwards between steps, recomputation, lending."""
