"""Benchmarks of the ``gefen bench`` command and the one report schema they share."""
