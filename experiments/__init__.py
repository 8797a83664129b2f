"""Hydra experiments: LightningModules, data and the training entry point."""
