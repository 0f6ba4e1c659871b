"""What sits beside the package: the documentation site and the benchmarks."""
