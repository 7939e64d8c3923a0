"""Experiment machinery: train-and-evaluate over seeds, checkpoints, sharding, plots."""
