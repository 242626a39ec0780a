"""Stage 05: its plan, the run, the report, and the quickstart's time estimate."""
