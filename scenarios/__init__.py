"""Workload definitions (TOML files) shipped with pagedbench."""
