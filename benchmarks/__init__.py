"""bench.py's larger sections, each in a module of its own."""
