"""Policies the project builds and trains itself (no model hub): recipes, bootstrap, loading."""
