"""Checks of the repository itself: the package maps, README and docs/ (tables, links, paths), the deploy files."""
