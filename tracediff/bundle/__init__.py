"""``tracediff bundle``: everything a bug report needs about two traces that disagree, within a size
budget: a slice of both around the first divergence that reproduces the verdict, the compare report
(Markdown, JSON, HTML), both sides' environments, summary statistics of the rest, the commands to
reproduce. ``make_bundle`` in build.py is the entry point."""
