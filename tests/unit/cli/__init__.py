"""Unit tests of the command line: its defaults, its entries by module, the scaler's decisions."""
