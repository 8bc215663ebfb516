"""Adapters to real engines (training and generation) and the small torch rollout engine."""
