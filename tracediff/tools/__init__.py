"""The commands as library calls: each takes paths and options and returns one frozen, typed result.

``compare`` (a ``Report``), ``replay`` (a ``ReplayReport``), ``explain`` (an ``Explanation``), ``doctor``
(a ``DoctorReport``); the CLI parses, calls one of these and renders what it returns (report/), so that
a notebook or a test gets exactly what the command prints.
"""
