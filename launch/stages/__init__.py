"""The data stages and tools around training: `kiln eval` (eval/), `kiln sft` (sft/), `kiln rft` (rft/),
`kiln tasks` (tasks.py), `kiln export`, `kiln verify`, and decontamination against evaluation tasks."""
