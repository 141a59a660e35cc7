"""What `kiln train` runs: the driver loop (train.py), one run's session, the actors' wiring, supervisor and
typed handles, the metrics monitor, the placement plan, the start-up checks and the run directory."""
