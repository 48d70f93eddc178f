"""Benchmark and measurement scripts (python experiments/benchmarks/X.py or python -m
rlx.experiments.benchmarks.X); installed as rlx.experiments.benchmarks. Experiment configs
stay one folder up, in experiments/."""
