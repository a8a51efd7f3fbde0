"""Front ends: importers that turn models of other frameworks into polyhal programs.

Each front end lives in its own subpackage and imports its framework lazily, so that
``import polyhal`` never pulls it in. :mod:`polyhal.frontends.onnx` is the ONNX one
(``polyhal.onnx.load``).
"""
