"""The torch watcher as a producer: ``tracediff record --watch GLOB -- CMD`` records modules of any
PyTorch program by dotted name (any program that imports torch; no model code of ours).

Modules: ``watcher`` (the global hooks), ``keys`` (row keys), ``names`` (trace names and the model's
identity), ``plugin`` (the launcher's start-up plugin), ``producer`` (what the launcher knows of it).
"""
