"""What a run shows: metrics.jsonl and TensorBoard, progress rows, the live view, the timeline, episode dumps,
the mechanisms table, verifier outcomes, and the end-of-run report with its plots."""
