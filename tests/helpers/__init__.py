"""Helpers the tests share: synthetic episodes and the replay staleness simulation."""
