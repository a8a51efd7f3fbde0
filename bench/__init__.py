"""Side-by-side benchmarks: polyhal against the library a user would call instead."""
