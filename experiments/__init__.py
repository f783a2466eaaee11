"""Small-scale studies of BAPO on the embedded trainer: grids (`grid`), the resumable runner (`run`,
`worker`) and the summary of their MLflow stores into docs/results.md (`summarize`)."""
