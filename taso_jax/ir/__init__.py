"""The graph IR: hash-consed immutable graphs and the JAX executor that runs them."""
