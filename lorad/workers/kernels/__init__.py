"""Triton kernels for the worker's hot paths, each beside a plain-torch reference of the same math.

Importing a kernel module needs triton (the `gpu` extra); the rest of lorad never imports one on a
machine without it.
"""
