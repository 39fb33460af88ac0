"""Cases and tiny models shared by the test suite and the benchmarks (which never import tests/)."""
