"""The comparison harness: tasks and prompts (more to come: runner, report)."""
