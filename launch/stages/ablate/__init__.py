"""`kiln ablate`: the same short training with each mechanism of the algorithm switched off in turn
(docs/ablation.md). arms.py names the arms, run.py runs them, summary.py turns their metrics into
the table, plot.py draws one figure per mechanism, cli.py is the command."""
