"""Checks run by the pipeline after the baseline, after every stage and after export.

They use only the :class:`export.decoding.runtime.Runner` interface, so an exported artifact is
measured by exactly the code that measured the eager model before it.
"""
