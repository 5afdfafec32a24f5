"""Tuning: timing and (as they land) the engine and one module per family."""
