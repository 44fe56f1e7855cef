"""DP synthetic data for semantic parsing (SMCalFlow, TreeDST): Lispress, metrics, experiments."""
