"""Training loop and distributed parts, plus the model and text sources everything builds on.

Submodules are imported explicitly; importing ``train`` itself loads nothing heavy.
"""
