"""Built-in example data, so that every command runs on a fresh machine with no download."""
