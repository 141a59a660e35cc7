"""`kiln sft`: supervised fine-tuning on chat examples with the learner's own SFT step (launch/stages/sft/cli.py)."""
