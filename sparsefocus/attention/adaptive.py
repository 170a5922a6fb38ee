"""Placeholder: filled in by the mechanism family's author."""
