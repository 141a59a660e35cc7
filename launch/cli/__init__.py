"""The `kiln` command: its entry point (main.py), which registers every subcommand, and `kiln config --markdown`'s
configuration reference (config_doc.py). Nothing outside this package imports it."""
