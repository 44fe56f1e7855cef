"""End-to-end experiment drivers (they import the data layer: not DP core)."""
