"""Getting traces out of other producers: importers of their dumps, and hooks into their code."""
