"""The `qvl` command line (app.py) and its tools: local runs (local_run, progress_view, run_report, runs,
published, rejected_samples), and the checks before GPUs are spent (memory_plan, rehearse, real_checkpoints)."""
