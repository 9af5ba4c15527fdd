"""Runnable examples on real data (see the README)."""
