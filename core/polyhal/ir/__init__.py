"""Program IR: tensor types, affinities, values, ops and the builder."""
