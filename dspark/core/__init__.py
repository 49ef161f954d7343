"""The algorithm core: pure modules with no model, engine or server in them."""
