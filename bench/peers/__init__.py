"""Peer serving systems the benchmarks run beside pdserve, each in its own virtual environment."""
