"""Test bed: tiny real models, CPU harnesses and reference loops used by tests and scripts.

Not shipped: the package ``tracediff`` never imports it (tests/test_layout.py keeps it so).
"""
