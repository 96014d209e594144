"""Rendering results for people (terminal, Markdown) and machines (JSON). Never reads files."""
