"""Testing support: the conformance suite every backend runs (``conformance``) and its pytest
plugin (``plugin``, auto-loaded by pytest through the ``pytest11`` entry point)."""
