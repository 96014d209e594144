"""``python -m tracediff``: the command line, as the ``tracediff`` console script runs it."""

from tracediff.entry import main

main()
