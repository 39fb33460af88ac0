"""jaxllm's benchmark tools, run from a checkout of the repository with jaxllm installed:
`python -m benchmarks.NAME` (benchmarks/README.md lists them). A regular package, not a namespace one, so
that another distribution's top-level `benchmarks` package cannot shadow it."""
