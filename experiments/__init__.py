"""Experiment configs (get_config(arg)) and benchmark scripts; installed as rlx.experiments."""
