"""The course's runs: what lessons, widgets, the CLI and benchmarks launch.

One module per topic. The library (`parcourse.zero`, `parcourse.data_parallel`, ...)
is what a user imports to train; these modules measure it, and keep the lessons'
rank functions out of it. Formulas they compare with live in `parcourse.theory`.
"""
