"""The `pagedbench` command line."""
