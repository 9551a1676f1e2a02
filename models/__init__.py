"""Data shipped with duet: the model catalog and the bundled demo model (a package so the wheel carries it)."""
