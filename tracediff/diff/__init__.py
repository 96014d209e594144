"""Comparing two traces: align rows by content, measure, find the first divergence, diagnose."""
