"""Tools that measure the runtime, kept apart from it: the benchmarks behind `edgetp bench` and
`edgetp bench-serve`, and the synthetic-model writer behind `edgetp synth`."""
