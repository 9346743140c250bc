"""Checks of the repository itself: the package maps, README's tables, the deploy files."""
