"""The experiments: scripts that measure DAMCHA against its baselines, and what they share (not installed)."""
