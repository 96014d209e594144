"""The package's version: its one home, below every layer (the run metadata records it).

``tracediff.__version__`` re-exports it.
"""

__version__ = "0.1.0"
